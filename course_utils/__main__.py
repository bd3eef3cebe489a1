"""Command line: `python -m course_utils check|progress|reset|build|html|timings ...`."""

import argparse
import sys
from pathlib import Path

from course_utils.build import build, learner_path, root, source_notebooks


def find_notebook(lesson: str, solutions: bool = False) -> Path:
    """A lesson's notebook from its number ('01') or a path."""
    path = Path(lesson)
    if path.suffix == ".ipynb":
        if not path.exists():
            sys.exit(f"no such notebook: {path}")
        return path
    matches = [s for s in source_notebooks() if s.name.startswith(f"{int(lesson):02d}_")] if lesson.isdigit() else []
    if not matches:
        sys.exit(f"no lesson {lesson!r}: give a number such as 01, or a path to a notebook")
    return matches[0] if solutions else learner_path(matches[0])


def check(notebook: Path) -> int:
    """Run nbval over one notebook in check mode and print the exercise scoreboard."""
    from course_utils.pytest_plugin import scoreboard_lines
    from course_utils.workspace import run_checker

    try:
        results = run_checker([notebook])
    except RuntimeError as err:
        print(err)
        return 1
    print("\n".join(scoreboard_lines(results)) or f"{notebook.name} has no exercises")
    stopped = [nb["stopped_at"] for nb in results.values() if nb["stopped_at"]]
    if stopped:
        print(f"\nA cell that is not an exercise failed ({stopped[0]}), so the checker stopped there.")
        print(f"Open {notebook} and run it top to bottom to see the full error.")
    statuses = [v["status"] for nb in results.values() for v in nb["exercises"].values()]
    return 0 if statuses and all(s == "passed" for s in statuses) and not stopped else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_build = sub.add_parser("build", help="regenerate the learner copies from notebooks/solutions/")
    p_build.add_argument("lessons", nargs="*", help="lesson numbers (default: all)")
    p_build.add_argument("--execute", action="store_true", help="re-run each solution notebook first, refreshing its outputs")
    p_reset = sub.add_parser("reset", help="give yourself a fresh copy of a lesson (your current file is backed up first)")
    p_reset.add_argument("lesson", help="lesson number, e.g. 03")
    sub.add_parser("progress", help="check every lesson and print a table of your progress")
    p_html = sub.add_parser("html", help="render the solution notebooks to static HTML for the classroom")
    p_html.add_argument("--out", default=None, help="output folder (default: build/html)")
    p_time = sub.add_parser("timings", help="time every lesson under nbval and the checker; rewrite README's course map")
    p_time.add_argument("--repeat", type=int, default=3, help="runs per lesson (the median is reported)")
    p_time.add_argument("--no-write", action="store_true", help="print the table instead of writing README.md")
    p_check = sub.add_parser("check", help="check your exercises in one lesson and print a scoreboard")
    p_check.add_argument("lesson", help="lesson number (01) or a notebook path")
    p_check.add_argument("--solutions", action="store_true", help="check the solution copy instead of yours")
    args = parser.parse_args(argv)

    if args.command == "build":
        sources = [find_notebook(lesson, solutions=True) for lesson in args.lessons] or None
        for path, saved in build(sources, run=args.execute):
            print(f"wrote {path.relative_to(root())}" + (f" (the previous file is kept as {saved.name})" if saved else ""))
        return 0
    if args.command == "reset":
        from course_utils.workspace import reset

        source = find_notebook(args.lesson, solutions=True)
        saved = reset(source)
        target = learner_path(source).relative_to(root())
        print(f"{target} is a fresh copy" + (f"; your previous file is kept as {saved.relative_to(root())}" if saved else " (it was already fresh)"))
        return 0
    if args.command == "progress":
        from course_utils.workspace import progress

        print(progress())
        return 0
    if args.command == "html":
        from course_utils.classroom import build_html  # nbconvert: slow to import, so only here

        pages = build_html(args.out)
        print(f"wrote {len(pages) - 1} lesson pages and {pages[0]}")
        return 0
    if args.command == "timings":
        from course_utils.timings import course_map, write_readme

        table = course_map(args.repeat)
        if args.no_write:
            print(table)
        else:
            write_readme(table)
            print("README.md course map updated")
        return 0
    return check(find_notebook(args.lesson, solutions=args.solutions))


if __name__ == "__main__":
    sys.exit(main())
