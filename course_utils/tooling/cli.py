"""Command line: `python -m course_utils lab|check|progress|workspace|reset|restore|grade|autograder|html|build|timings ...`.

Every error a learner can cause or meet (a bad lesson number, a missing or truncated
notebook, a read-only folder, Ctrl-C) is printed as one line that says what to do, with
no traceback.
"""

import argparse
import difflib
import sys
from pathlib import Path

from course_utils.tooling.language import N_, _
from course_utils.tooling.layout import (
    CourseError, lesson_number, read_notebook_json, shown, source_for, work_dir, work_path,
)


def find_notebook(lesson: str, solutions: bool = False) -> Path:
    """A lesson's notebook from its number ('01'): the learner's own copy in work/, or the solution copy; or a path."""
    path = Path(lesson)
    if path.suffix == ".ipynb":
        return path
    source = source_for(lesson)
    if solutions:
        return source
    mine = work_path(source)
    if not mine.exists():
        raise CourseError(_("{notebook} does not exist yet: `make lab` (or `python -m course_utils workspace`) makes your copies").format(
            notebook=shown(mine)))
    return mine


def check(notebook: Path, lesson: str | None = None) -> int:
    """Run the checker over one notebook, print its scoreboard, and record the verdicts when it is the learner's own.

    lesson: the lesson the learner asked for (`check 00`); a notebook that holds another one is
    refused in one line, before a kernel starts, and nothing is recorded.
    """
    from course_utils.tooling.progress import other_lesson, wrong_lesson_message
    from course_utils.tooling.pytest_plugin import scoreboard_lines
    from course_utils.tooling.runner import run_checker

    nb = read_notebook_json(notebook)  # a missing, empty or truncated file is named before a kernel starts
    held = other_lesson(notebook, nb)
    if held and lesson:
        raise CourseError(wrong_lesson_message(notebook, held))
    saved = notebook.stat().st_mtime  # the file the checker reads is the one saved before this moment
    results = run_checker([notebook])
    result = next(iter(results.values()), None)
    if not result or (not result["exercises"] and not result["stopped_at"]):
        raise CourseError(_("{notebook} has no exercises of this course (is it a lesson notebook?)").format(notebook=shown(notebook)))
    print("\n".join(scoreboard_lines(results)))
    if result["stopped_at"]:
        print("\n" + _("The checker stopped at {cell}, so the cells after it did not run.").format(cell=result["stopped_at"].split(":")[0]))
        print(_("Open {notebook} and run it top to bottom to see the full error.").format(notebook=shown(notebook)))
    judged = result.get("lesson")
    if judged and notebook.resolve().parent == work_dir().resolve():
        if held:  # a path given by hand: judged as what it holds, recorded as neither lesson
            print("\n" + _("Not recorded: {reason}").format(reason=wrong_lesson_message(notebook, held)))
        else:
            record_checked(judged, result, saved)
    statuses = [v["status"] for v in result["exercises"].values()]
    return 0 if statuses and all(s == "passed" for s in statuses) and not result["stopped_at"] else 1


def record_checked(lesson: str, result: dict, saved: float) -> None:
    """Record the checker's verdicts of a learner's saved notebook; say so in one line when the notebook has newer, better ones.

    Those newer verdicts were recorded by the notebook's own check cells after the file was last
    saved, so the saved file is behind what the learner sees: they stay in the record.
    """
    from course_utils.tooling.progress import newer_in_notebook, save_verdicts, unsaved_message
    from course_utils.tooling.verdicts import Verdict

    verdicts = [Verdict(name, v["status"], v["reason"]) for name, v in result["exercises"].items()]
    newer = newer_in_notebook(work_dir(), lesson, verdicts, saved)
    save_verdicts(work_dir(), lesson, verdicts, replace=True, keep=newer)
    if newer:
        print(f"\n{unsaved_message(lesson)}")


def progress(recheck: bool) -> int:
    """Print the progress table from the recorded verdicts (re-checking every lesson first with recheck)."""
    from course_utils.tooling.progress import format_progress, notebook_problem, progress_table
    from course_utils.tooling.runner import run_checker

    if recheck:
        from course_utils.tooling.layout import source_notebooks

        mine = [work_path(s) for s in source_notebooks()]
        readable = [p for p in mine if notebook_problem(p) is None]
        saved = {str(p.resolve()): p.stat().st_mtime for p in readable}  # by the plugin's names for them
        if readable:
            for path, result in run_checker(readable).items():
                if result.get("lesson"):
                    record_checked(result["lesson"], result, saved.get(path, 0.0))
    table = progress_table()
    print(format_progress(table))
    if table.attrs["problems"]:
        print(_("Fix or `reset` the notebooks named above (`reset` keeps a backup of yours)."))
        return 1
    return 0


# The commands in --help, by who uses them: the learner's first. Headings and help are translated when shown (N_).
GROUPS = {
    N_("your work"): ["lab", "check", "progress", "workspace", "reset", "restore"],
    N_("for instructors"): ["grade", "autograder", "html"],
    N_("for the course's maintainers"): ["build", "translations", "timings"],
}
HELP = {
    "lab": N_("open the course in JupyterLab, on lesson 00 (makes your copies in work/ first)"),
    "check": N_("check your exercises in one lesson (the saved file) and print a scoreboard"),
    "progress": N_("a table of your progress in every lesson (from your latest checks)"),
    "workspace": N_("make your own copy of every lesson in work/ that you do not have yet"),
    "reset": N_("a fresh copy of a lesson in work/ (your current file is backed up first)"),
    "restore": N_("bring back a backup of a lesson (your current file is backed up first)"),
    "grade": N_("grade a folder of submitted notebooks: a CSV, summary tables, an HTML page"),
    "autograder": N_("write a Gradescope autograder for lessons (autograder-NN.zip)"),
    "html": N_("render the solution notebooks to static HTML for the classroom"),
    "build": N_("regenerate the course's learner copies in notebooks/ from notebooks/solutions/"),
    "translations": N_("merge the translation catalogs with the English, or list what is left to translate"),
    "timings": N_("time every lesson under nbval and the checker; rewrite README's course map"),
}


def command_list() -> str:
    """The commands, group by group, as --help lists them."""
    width = max(map(len, HELP))
    parts = []
    for group, names in GROUPS.items():
        parts.append(f"{_(group)}:\n" + "\n".join(f"  {name:{width}}  {_(HELP[name])}" for name in names))
    return "\n\n".join(parts) + "\n\n" + _("`python -m course_utils COMMAND --help` describes one command.")


def _sentence(text: str) -> str:
    """A command's help as its description: capitalised, with a full stop ('a table of ...' -> 'A table of ....')."""
    return _("{sentence}.").format(sentence=text[:1].upper() + text[1:])


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line's parser and each command's own (for errors printed with that command's usage)."""
    parser = argparse.ArgumentParser(prog="python -m course_utils", usage="%(prog)s [-h] COMMAND ...",
                                     description=_("The course's commands: the learner's first, then the instructor's and the maintainers'."),
                                     epilog=command_list(), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS)
    commands: dict[str, argparse.ArgumentParser] = {}

    def add(name: str, description: str | None = None) -> argparse.ArgumentParser:
        described = description or _sentence(_(HELP[name]))
        commands[name] = sub.add_parser(name, prog=f"python -m course_utils {name}", description=described)
        return commands[name]

    p_lab = add("lab", _("Open the course in JupyterLab, on lesson 00. Other options are passed on to "
                         "`jupyter lab` (e.g. --port=8889 --no-browser)."))
    p_lab.add_argument("--lang", choices=["en", "zh"], help=_("the course's language, kept for later runs: en (English) or zh "
                                                             "(简体中文): your new copies and the checks' messages"))
    p_check = add("check", _("Check your exercises in one lesson and print a scoreboard. It runs the notebook as it is saved: "
                             "save it first (Ctrl-S in JupyterLab)."))
    p_check.add_argument("lesson", help=_("lesson number (01), or a notebook path"))
    p_check.add_argument("--solutions", action="store_true", help=_("check the solution copy instead of yours"))
    p_progress = add("progress")
    p_progress.add_argument("--recheck", action="store_true", help=_("run the checker over every lesson first (slow, exact)"))
    p_workspace = add("workspace")
    p_workspace.add_argument("--lang", choices=["en", "zh"], help=_("the language of the copies, kept for later runs (as lab --lang)"))
    p_reset = add("reset")
    p_reset.add_argument("lesson", help=_("lesson number, e.g. 03"))
    p_reset.add_argument("--force", action="store_true", help=_("go ahead even while a JupyterLab tab has the notebook open"))
    p_restore = add("restore")
    p_restore.add_argument("lesson", help=_("lesson number, e.g. 03"))
    p_restore.add_argument("backup", nargs="?", help=_("the backup's file name (default: the newest)"))
    p_restore.add_argument("--list", action="store_true", help=_("list the lesson's backups instead: when, by which command, how many passed"))
    p_restore.add_argument("--force", action="store_true", help=_("go ahead even while a JupyterLab tab has the notebook open"))
    p_grade = add("grade", _("Grade every notebook under DIR with the checker, each in a sandbox of its own "
                             "(bubblewrap: Debian/Ubuntu package `bubblewrap`): the course is read-only there, and "
                             "DIR, the other submissions, the gradebook, the network and your environment are absent."))
    p_grade.add_argument("folder", metavar="DIR", help=_("the folder of submissions (its *.ipynb files, any names; nothing is written to it)"))
    p_grade.add_argument("--out", metavar="FILE.csv", help=_("write one row per submission per exercise to this CSV"))
    p_grade.add_argument("--html", metavar="FILE.html", help=_("write a self-contained page with the summary and a pass-rate chart"))
    p_grade.add_argument("--jobs", type=int, default=None, metavar="N", help=_("submissions checked at once (default: the number of cores)"))
    p_grade.add_argument("--exercise-timeout", type=float, default=None, metavar="S", help=_("time limit of one exercise (default: the checker's, 30 s)"))
    p_grade.add_argument("--cell-timeout", type=float, default=None, metavar="S", help=_("time limit of any other cell (default: the checker's, 600 s)"))
    p_grade.add_argument("--timeout", type=float, default=900, metavar="S", help=_("time limit of a whole submission (default 900 s)"))
    p_grade.add_argument("--feedback", metavar="DIR2", help=_("write one HTML page per submission, its scoreboard with each reason, to send back"))
    p_grade.add_argument("--retry-errors", action="store_true",
                         help=_("grade again only the submissions whose rows in the --out CSV are `error` (the grader failed, not them)"))
    p_grade.add_argument("--no-sandbox", action="store_true",
                         help=_("grade without bubblewrap (UNSAFE: a submission can then read and change anything you can); the gradebook records it"))
    p_grade.add_argument("--memory-mb", type=int, default=None, metavar="MB", help=_("memory limit of each process of a submission"))
    p_grade.add_argument("--max-processes", type=int, default=None, metavar="N", help=_("process limit of a submission's user"))
    p_grade.add_argument("--max-open-files", type=int, default=None, metavar="N", help=_("open-file limit of each process"))
    p_grade.add_argument("--max-file-size-mb", type=int, default=None, metavar="MB", help=_("largest file a submission may write"))
    p_autograder = add("autograder", _("Write autograder-NN.zip for each lesson given (`all`: every lesson), to upload to a Gradescope "
                                       "assignment: it installs the course and grades each upload with its checks (README: Grading on Gradescope)."))
    p_autograder.add_argument("lessons", nargs="+", metavar="NN", help=_("lesson numbers, or `all`"))
    p_autograder.add_argument("--out", default="build/autograder", help=_("folder for the zips (default: build/autograder)"))
    p_autograder.add_argument("--points", metavar="FILE", help=_("an autograder.toml with your points per exercise (one lesson only)"))
    p_html = add("html")
    p_html.add_argument("--out", default=None, help=_("output folder (default: build/html)"))
    p_build = add("build")
    p_build.add_argument("lessons", nargs="*", help=_("lesson numbers (default: all)"))
    p_build.add_argument("--execute", action="store_true", help=_("re-run each solution notebook first, refreshing its outputs"))
    p_build.add_argument("--lang", choices=["en", "zh"], default="en",
                         help=_("the edition to build: zh writes notebooks/zh-CN/ from the English and notebooks/locale/zh_CN/"))
    p_translations = add("translations")
    p_translations.add_argument("action", choices=["update", "status"],
                                help=_("update: merge the catalogs with the current English (changed text goes fuzzy); "
                                       "status: list what is untranslated or fuzzy"))
    p_time = add("timings")
    p_time.add_argument("lessons", nargs="*", help=_("time only these lessons, with the floor, and print the times (README is left alone)"))
    p_time.add_argument("--repeat", type=int, default=3, help=_("runs per lesson (the median is reported)"))
    p_time.add_argument("--no-write", action="store_true", help=_("print the table instead of writing README.md"))
    p_time.add_argument("--keep-times", action="store_true",
                        help=_("measure nothing: refresh topics, exercises, study time and GPU cells, keep README's times"))
    assert set(commands) == set(HELP) == {n for names in GROUPS.values() for n in names}
    return parser, commands


def unknown_command(argv: list[str], names: list[str]) -> str | None:
    """'unknown command 'chek': did you mean check?' for a first word that is no command (difflib), else None."""
    word = next((a for a in argv if not a.startswith("-")), None)
    if word is None or word in names:
        return None
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    if close:
        return _("unknown command {word!r}: did you mean {command}?").format(word=word, command=close[0])
    return _("unknown command {word!r}: the commands are {commands}").format(word=word, commands=", ".join(names))


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    unknown = unknown_command(argv, list(commands))
    if unknown:
        parser.error(unknown)
    args, rest = parser.parse_known_args(argv)
    command = commands[args.command]
    if rest and args.command != "lab":  # only `lab` passes options on (to jupyter lab)
        command.error(_("unrecognized arguments: {arguments}").format(arguments=" ".join(rest)))
    if args.command == "restore" and args.list and args.backup:
        command.error(_("--list lists every backup of lesson {lesson}: give it no backup name ({backup!r})").format(
            lesson=args.lesson, backup=args.backup))
    args.jupyter_args = rest
    try:
        return _run(args)
    except CourseError as err:
        print(_("error: {message}").format(message=err), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(_("interrupted: the checker and its kernels were stopped; your notebooks are as they were"), file=sys.stderr)
        return 130
    except ModuleNotFoundError as err:  # e.g. a bare `python` in a terminal that is not the course's
        print(_("error: this Python ({python}) has no {module}, which the course needs: "
                "run `.venv/bin/python -m course_utils ...` from the course folder (`make lab` creates .venv)").format(
                    python=sys.executable, module=err.name), file=sys.stderr)
        return 1
    except OSError as err:
        if err.filename:
            message = _("error: {file}: {problem} (is the folder writable, and is there disk space?)").format(
                file=err.filename, problem=err.strerror or err)
        else:
            message = _("error: {problem} (is the folder writable, and is there disk space?)").format(problem=err.strerror or err)
        print(message, file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.command == "lab":
        from course_utils.tooling.lab import main as lab

        if args.lang:
            from course_utils.tooling.language import remember

            remember(args.lang)
        return lab(args.jupyter_args)
    if args.command == "check":
        asked = None if Path(args.lesson).suffix == ".ipynb" else lesson_number(args.lesson)
        return check(find_notebook(args.lesson, solutions=args.solutions), asked)
    if args.command == "progress":
        return progress(args.recheck)
    if args.command == "workspace":
        from course_utils.tooling.workspace import ensure_workspace

        if args.lang:
            from course_utils.tooling.language import remember

            remember(args.lang)
        made = ensure_workspace()
        if made:
            print(_("made {n} notebooks in {folder}").format(n=len(made), folder=shown(work_dir())))
        else:
            print(_("{folder} has every lesson").format(folder=shown(work_dir())))
        return 0
    if args.command == "reset":
        from course_utils.tooling.opentabs import TabGuard
        from course_utils.tooling.workspace import reset

        guard = TabGuard(f"reset {lesson_number(args.lesson)}", force=args.force)
        target, saved = reset(args.lesson, guard=guard)
        if saved:
            print(_("{notebook} is a fresh copy; your previous file is kept as {backup}").format(notebook=shown(target), backup=shown(saved)))
        else:
            print(_("{notebook} is a fresh copy (it was already fresh)").format(notebook=shown(target)))
        if guard.advice:
            print(guard.advice)
        return 0
    if args.command == "restore":
        from course_utils.tooling.opentabs import TabGuard
        from course_utils.tooling.workspace import backup_listing, restore

        if args.list:
            print(backup_listing(args.lesson))
            return 0
        guard = TabGuard(f"restore {lesson_number(args.lesson)}", force=args.force)
        target, used, saved = restore(args.lesson, args.backup, guard=guard)
        if saved:
            print(_("{notebook} is now {backup}; the file it replaced is kept as {kept}").format(
                notebook=shown(target), backup=used.name, kept=shown(saved)))
        else:
            print(_("{notebook} is now {backup}").format(notebook=shown(target), backup=used.name))
        if guard.advice:
            print(guard.advice)
        return 0
    if args.command == "grade":
        from course_utils.tooling.grade import main as grade
        from course_utils.tooling.sandbox import Limits

        chosen = {"memory_mb": args.memory_mb, "processes": args.max_processes, "open_files": args.max_open_files,
                  "file_size_mb": args.max_file_size_mb}
        limits = Limits(**{name: value for name, value in chosen.items() if value is not None})
        return grade(args.folder, args.out, args.html, args.jobs, args.exercise_timeout, args.cell_timeout, args.timeout,
                     feedback=args.feedback, retry_errors=args.retry_errors, sandboxed=not args.no_sandbox, limits=limits)
    if args.command == "autograder":
        from course_utils.tooling.autograder import build as autograder

        return autograder(args.lessons, args.out, args.points)
    if args.command == "build":
        from course_utils.tooling.build import build
        from course_utils.tooling.translations import build as build_edition

        sources = [source_for(lesson) for lesson in args.lessons] or None
        made = build(sources, run=args.execute) if args.lang == "en" else build_edition(args.lang, sources, run=args.execute)
        for path in made:
            print(_("wrote {path}").format(path=shown(path)))
        return 0
    if args.command == "translations":
        from course_utils.tooling.translations import status, update_all

        if args.action == "update":
            for path in update_all():
                print(_("updated {path}").format(path=shown(path)))
            return 0
        left = status()
        print("\n".join(left) if left else _("every unit of every lesson and every message has a current translation"))
        return 1 if left else 0
    if args.command == "html":
        from course_utils.tooling.classroom import build_html  # nbconvert: slow to import, so only here

        pages = build_html(args.out)
        print(_("wrote {n} lesson pages and {index}").format(n=len(pages) - 1, index=pages[0]))
        return 0
    if args.command == "timings":
        from course_utils.tooling.timings import course_map, measure, refreshed_map, write_readme

        if args.lessons:
            measure([source_for(lesson) for lesson in args.lessons], args.repeat)
            return 0
        table = refreshed_map() if args.keep_times else course_map(args.repeat)
        if args.no_write:
            print(table)
        else:
            write_readme(table)
            print(_("README.md course map updated"))
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
