"""The Gradescope autograder (course_utils.tooling.autograder), tested without Gradescope.

One module fixture builds autograder-05.zip with the command, unpacks it into temporary folders
laid out like Gradescope's /autograder (source/, submission/, results/, run_autograder), which
run_autograder takes from COURSE_AUTOGRADER_ROOT (used by these tests only), and runs it once per
submission: solved, half-solved and renamed (one notebook: `homework 5 (final).ipynb`, its lesson
stamp removed, its other exercises untouched), empty, missing, another lesson's notebook, a PDF,
and a solved copy that tries to write results.json and the course's files, in a bubblewrap sandbox
and again with the privilege drop that serves where a container allows no sandbox. `grade` grades the half-solved
notebook in the same fixture, to compare scores. Every results.json is checked against a JSON
Schema written here from Gradescope's published specification (gradescope-autograders.readthedocs.io,
"Autograder Specifications", Output format).
"""

import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import nbformat
import pytest

from course_utils.tooling import autograder, sandbox
from course_utils.tooling.layout import CourseError, exercises, root, source_for
from test_grade import learner, solved

LESSON = "05"
NAMES = [e.name for e in exercises(LESSON)]
FORMATS = ["text", "html", "simple_format", "md", "ansi"]
VISIBILITY = ["hidden", "after_due_date", "after_published", "visible"]
TEST_CASE = {
    "type": "object",
    "properties": {
        "score": {"type": "number"},
        "max_score": {"type": "number"},
        "status": {"enum": ["passed", "failed"]},
        "name": {"type": "string"},
        "name_format": {"enum": FORMATS},
        "number": {"type": "string"},
        "output": {"type": "string"},
        "output_format": {"enum": FORMATS},
        "tags": {"type": "array", "items": {"type": "string"}},
        "visibility": {"enum": VISIBILITY},
        "extra_data": {"type": "object"},
    },
    "additionalProperties": False,
}
RESULTS_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "score": {"type": "number"},
        "execution_time": {"type": "number"},
        "output": {"type": "string"},
        "output_format": {"enum": FORMATS},
        "test_output_format": {"enum": FORMATS},
        "test_name_format": {"enum": FORMATS},
        "visibility": {"enum": VISIBILITY},
        "stdout_visibility": {"enum": VISIBILITY},
        "extra_data": {"type": "object"},
        "tests": {"type": "array", "items": TEST_CASE},
        "leaderboard": {"type": "array", "items": {
            "type": "object", "required": ["name", "value"],
            "properties": {"name": {"type": "string"}, "value": {"type": ["number", "string"]}, "order": {"enum": ["asc", "desc"]}},
        }},
    },
    "additionalProperties": False,
    # "score: optional, but required if not on each test case"
    "anyOf": [{"required": ["score"]}, {"required": ["tests"], "properties": {"tests": {"items": {"required": ["score"]}}}}],
}
# What this autograder promises beyond the specification: every exercise is a test with all five fields.
OUR_TEST = {**TEST_CASE, "required": ["name", "score", "max_score", "status", "output"]}
COMPARED = ("half renamed",)  # graded by `grade` too, in the same fixture: it holds passes and untouched stubs
LATE = f"course-autograder-late-writer-{os.getpid()}"  # in the command line of the hostile copies' late writers
TOP_LEVEL = {"setup.sh", "run_autograder", "autograder.toml", "lessons.json", "pyproject.toml", "constraints.txt", "README.md", "LICENSE"}


def validate(data: dict) -> None:
    jsonschema.Draft202012Validator(RESULTS_SCHEMA).validate(data)
    for test in data["tests"]:
        jsonschema.Draft202012Validator(OUR_TEST).validate(test)


def half_solved():
    """The first three exercises solved, the rest untouched; renamed, and its lesson stamp removed."""
    nb, done = learner(LESSON), solved(LESSON)
    for name in NAMES[:3]:
        tag = f"exercise:{name}"
        source = next(c for c in done.cells if tag in c.metadata.get("tags", []))
        next(c for c in nb.cells if tag in c.metadata.get("tags", [])).source = source.source
    nb.metadata.pop("course", None)
    return nb


def hostile(base: Path):
    """A solved copy whose own cell tries to write results.json, the course's files and a forged file, now and
    after grading, looks at its frames (so it is flagged for review), and fails its cell if any write worked."""
    targets = ["/autograder/results/results.json", base / "results" / "results.json", base / "results" / "forged.txt",
               base / "source" / "autograder.toml", base / "source" / "course_utils" / f"lesson{LESSON}.py"]
    code = f"""
import os, subprocess, sys
frame = sys._getframe(0)
written = []
for target in {[str(t) for t in targets]!r}:
    try:
        with open(target, "a") as f:
            f.write('{{"score": 999}}')
        written.append(target)
    except OSError:
        pass
later = "sleep 3; " + "; ".join(f"echo forged >> '{{t}}'" for t in {[str(t) for t in targets[1:3]]!r}) + " # {LATE}"
subprocess.Popen(["sh", "-c", later], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
assert os.getuid() != 0, "the submission runs as root"
assert not written, f"the submission wrote {{written}}"
"""
    nb = solved(LESSON)
    first_code = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "import" in c.source)
    nb.cells.insert(first_code + 1, nbformat.v4.new_code_cell(code))
    return nb


def nobody_python() -> Path | None:
    """A Python the user nobody can run, of this one's version, for the privilege-drop runs (None where there is none).

    The tests' own .venv may lie under a folder only root may enter (pyenv in /root): then a venv of the
    system's Python of the same version, reading the .venv's packages through a .pth line, stands in for
    the one setup.sh makes on Gradescope from the system's Python.
    """
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if os.getuid() != 0 or not shutil.which("setpriv"):
        return None
    for candidate in (Path(sys._base_executable).resolve(), Path(f"/usr/bin/python{version}")):
        # test -r: the folders above it must be open to nobody too (running the file itself can still seem to work)
        if candidate.exists() and subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                                                  "test", "-r", str(candidate)]).returncode == 0:
            return candidate
    return None


def venv_reusing_packages(folder: Path, python: Path) -> Path:
    """A venv of `python` that imports this .venv's packages (not its editable course_utils: a .pth line runs no .pth)."""
    subprocess.run([str(python), "-m", "venv", "--without-pip", str(folder)], check=True)
    site = next(folder.glob("lib/python3*/site-packages"))
    packages = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir())
    (site / "course-packages.pth").write_text(packages + "\n")
    return folder


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def tree_hash(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def layout(zip_path: Path, base: Path, venv: Path, files: dict[str, bytes]) -> Path:
    """A folder laid out like Gradescope's /autograder: the zip in source/, run_autograder beside it, the upload in submission/."""
    base.mkdir(mode=0o755)
    with zipfile.ZipFile(zip_path) as archive:
        for info in archive.infolist():
            target = archive.extract(info, base / "source")
            os.chmod(target, (info.external_attr >> 16) & 0o777)
    shutil.copy2(base / "source" / "run_autograder", base / "run_autograder")
    (base / "venv").symlink_to(venv)
    (base / "submission").mkdir()
    for name, data in files.items():
        (base / "submission" / name).write_bytes(data)
    return base


def run_autograder(base: Path, isolation: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COURSE_", "PYTEST"))}
    env["COURSE_AUTOGRADER_ROOT"] = str(base)
    if isolation:
        env[autograder.ISOLATION_VARIABLE] = isolation
    started = time.perf_counter()
    run = subprocess.run([str(base / "run_autograder")], cwd=base, env=env, capture_output=True, text=True, timeout=900)
    return {"run": run, "seconds": time.perf_counter() - started, "before": None}


def notebook_bytes(nb) -> bytes:
    return nbformat.writes(nb).encode()


@pytest.fixture(scope="module")
def autograded(tmp_path_factory):
    """Build the zip once, run run_autograder on every case (two at a time) and grade the honest ones; return everything."""
    if sandbox.problem() is not None:
        pytest.skip(f"no bubblewrap sandbox here: {sandbox.problem()}")
    out = tmp_path_factory.mktemp("zip")
    made = subprocess.run([sys.executable, "-m", "course_utils", "autograder", LESSON, "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout + made.stderr
    zip_path = out / f"autograder-{LESSON}.zip"
    top = Path(tempfile.mkdtemp(prefix="course-autograder-"))  # 0700 under /tmp: opened for nobody below
    os.chmod(top, 0o755)
    venv = Path(sys.prefix)
    slow_python = nobody_python()
    nobody_venv = venv_reusing_packages(top / "nobody-venv", slow_python) if slow_python else None
    cases = {
        "solved": ({f"{source_for(LESSON).name}": notebook_bytes(solved(LESSON))}, None),
        "half renamed": ({"homework 5 (final).ipynb": notebook_bytes(half_solved())}, None),
        "empty": ({f"{source_for(LESSON).name}": b""}, None),
        "missing": ({}, None),
        "wrong lesson": ({f"{source_for(LESSON).name}": notebook_bytes(learner("00")), "answers.pdf": b"%PDF-1.4\n"}, None),
        "hostile bwrap": (None, "bwrap"),
    }
    if nobody_venv:
        cases["hostile setpriv"] = (None, "setpriv")
    bases = {}
    for i, (case, (files, isolation)) in enumerate(cases.items()):
        base = top / f"case{i}"
        if files is None:
            files = {"05_training.ipynb": notebook_bytes(hostile(base))}
        bases[case] = layout(zip_path, base, nobody_venv if isolation == "setpriv" else venv, files)
    sources = {case: tree_hash(base / "source") for case, base in bases.items()}
    honest = tmp_path_factory.mktemp("honest")
    for case in COMPARED:  # the solved copy's mapping (pass: full points) is the half-solved one's too
        name, data = next(iter(cases[case][0].items()))
        (honest / f"{case.replace(' ', '-')}.ipynb").write_bytes(data)
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {case: pool.submit(run_autograder, bases[case], cases[case][1]) for case in cases}
        grade_run = pool.submit(subprocess.run, [sys.executable, "-m", "course_utils", "grade", str(honest), "--out",
                                                 str(out / "grades.csv"), "--jobs", "1"], capture_output=True, text=True, timeout=900)
        runs = {case: future.result() for case, future in runs.items()}
        grade_run = grade_run.result()
    assert grade_run.returncode == 0, grade_run.stdout + grade_run.stderr
    late = [p for p in Path("/proc").glob("[0-9]*") if LATE.encode() in _cmdline(p)]
    assert not late, "a process the submission started outlived run_autograder"
    with open(out / "grades.csv", newline="") as f:
        grades = list(csv.DictReader(f))
    results = {}
    for case, base in bases.items():
        path = base / "results" / "results.json"
        assert path.exists(), f"{case}: no results.json\n{runs[case]['run'].stdout}\n{runs[case]['run'].stderr}"
        results[case] = json.loads(path.read_text())
        runs[case]["after"] = tree_hash(base / "source")
        runs[case]["before"] = sources[case]
    yield {"zip": zip_path, "results": results, "runs": runs, "grades": grades, "bases": bases, "made": made}
    shutil.rmtree(top, ignore_errors=True)


# ---------------------------------------------------------------- the zip

def test_zip_holds_the_course_parts_and_nothing_else(autograded):
    zip_path = autograded["zip"]
    assert zip_path.stat().st_size < autograder.MAX_ZIP_BYTES
    with zipfile.ZipFile(zip_path) as archive:
        names = archive.namelist()
        modes = {i.filename: (i.external_attr >> 16) & 0o777 for i in archive.infolist()}
        notebook = json.loads(archive.read(f"notebooks/solutions/{source_for(LESSON).name}"))
    top = {n for n in names if "/" not in n}
    assert top == TOP_LEVEL
    folders = {n.split("/", 1)[0] for n in names if "/" in n}
    assert folders == {"course_utils", "notebooks", "data"}
    assert [n for n in names if n.startswith("notebooks/")] == [f"notebooks/solutions/{source_for(LESSON).name}"]
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc") or "/." in n or n.startswith(".")]
    assert not [n for n in names if n.startswith(("work/", ".venv/", "tests/", "build/", "data/fashion/"))]
    assert modes["setup.sh"] == modes["run_autograder"] == 0o755
    assert all(not c.get("outputs") for c in notebook["cells"] if c["cell_type"] == "code")
    git = subprocess.run(["git", "ls-files", "course_utils", "data"], cwd=root(), capture_output=True, text=True)
    if git.returncode == 0 and git.stdout:  # a clone: the zip holds exactly what git tracks there, no untracked file
        tracked = {line for line in git.stdout.splitlines()}
        assert {n for n in names if n.startswith(("course_utils/", "data/"))} == tracked
    assert "wrote" in autograded["made"].stdout and "kB" in autograded["made"].stdout


def test_points_default_to_one_and_the_instructor_sets_them(tmp_path):
    config = autograder.config_text(LESSON)
    assert autograder.read_points(config, LESSON) == {name: 1.0 for name in NAMES}
    mine = tmp_path / "points.toml"
    mine.write_text(f'[points]\n{NAMES[0]} = 3\n{NAMES[1]} = 0.5\n')
    entries = autograder.zip_entries(LESSON, mine.read_text())
    points = autograder.read_points(entries["autograder.toml"].decode(), LESSON)
    assert points[NAMES[0]] == 3 and points[NAMES[1]] == 0.5 and points[NAMES[2]] == 1
    for text, said in ((f"[points]\nno_such = 2\n", "has no exercise no_such"), (f"[points]\n{NAMES[0]} = -1\n", "0 or more"),
                       ("[points\n", "not valid TOML"), (f'lesson = "01"\n', "for lesson 01, not lesson 05")):
        with pytest.raises(CourseError, match=said):
            autograder.zip_entries(LESSON, text)


def test_setup_sh_installs_the_pins_with_torchs_cpu_wheels(tmp_path):
    """setup.sh run against stubs: apt-get, a Python and its venv's pip only record what they are asked."""
    if os.getuid() != 0:
        pytest.skip("setup.sh runs as root on Gradescope (it chowns the course to root)")
    log, bin_dir, base = tmp_path / "log", tmp_path / "bin", tmp_path / "autograder"
    bin_dir.mkdir()
    (base / "source").mkdir(parents=True)
    for name, data in autograder.zip_entries(LESSON).items():
        (base / "source" / name).parent.mkdir(parents=True, exist_ok=True)
        (base / "source" / name).write_bytes(data)
    python = ('#!/bin/sh\necho "$(basename "$0") $*" >> LOG\n'
              'if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; fi\n'
              'if [ "$1" = "-c" ]; then case "$2" in *sys.version_info*) exit 0;; *) echo ok;; esac; fi\n').replace("LOG", str(log))
    for name in ("apt-get", "python3.12"):
        (bin_dir / name).write_text(python)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "COURSE_AUTOGRADER_ROOT": str(base)}
    run = subprocess.run(["bash", str(base / "source" / "setup.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    calls = log.read_text().splitlines()
    source, venv = base / "source", base / "venv"
    assert "apt-get install -y -qq --no-install-recommends bubblewrap ca-certificates" in calls
    assert f"python3.12 -m venv {venv}" in calls
    torch = calls.index(f"python -m pip install --quiet --no-deps --index-url https://download.pytorch.org/whl/cpu "
                        f"-c {source}/constraints.txt torch torchvision")
    course = calls.index(f"python -m pip install --quiet -c {source}/constraints.txt -e {source}")
    assert torch < course  # the CPU wheels first: the course's own install then finds torch==2.14.1 satisfied
    assert not [p for p in source.rglob("*") if p.stat().st_mode & 0o022]  # nobody can write the course


# ---------------------------------------------------------------- every results.json

def test_every_results_json_follows_gradescopes_specification(autograded):
    for case, data in autograded["results"].items():
        validate(data)
        assert [t["name"] for t in data["tests"]] == NAMES, case
        assert data["score"] == sum(t["score"] for t in data["tests"])
        assert data["output"] and data["execution_time"] >= 0
        assert autograded["runs"][case]["run"].returncode == 0, case


def test_the_schema_refuses_what_gradescope_would(autograded):
    good = autograded["results"]["solved"]
    for broken in ({**good, "tests": [{**good["tests"][0], "status": "ok"}]}, {"output": "no score anywhere"},
                   {**good, "visibility": "sometimes"}, {**good, "score": "6"}):
        with pytest.raises(jsonschema.ValidationError):
            validate(broken)


def scores(data: dict) -> dict[str, tuple[float, str]]:
    return {t["name"]: (t["score"], t["output"]) for t in data["tests"]}


def test_solved_and_half_solved(autograded):
    results = autograded["results"]
    assert results["solved"]["score"] == len(NAMES)
    assert results["solved"]["output"].startswith(f"Graded {source_for(LESSON).name} as lesson {LESSON}")
    assert all(t["status"] == "passed" for t in results["solved"]["tests"])
    half = scores(results["half renamed"])
    assert [half[n][0] for n in NAMES] == [1.0] * 3 + [0.0] * (len(NAMES) - 3)
    assert all(half[n][1].startswith("not attempted yet") for n in NAMES[3:])  # the untouched stubs
    assert results["half renamed"]["output"].startswith(f"Graded homework 5 (final).ipynb as lesson {LESSON}")


def test_scores_equal_grades_for_the_same_notebooks(autograded):
    by_submission = {}
    for row in autograded["grades"]:
        by_submission.setdefault(row["submission"], {})[row["exercise"]] = (row["status"], row["reason"])
    for case in COMPARED:
        graded = by_submission[f"{case.replace(' ', '-')}.ipynb"]
        for test in autograded["results"][case]["tests"]:
            status, reason = graded[test["name"]]
            assert (test["score"] == test["max_score"]) == (status == "pass"), (case, test)
            assert test["output"] == ("passed" if status == "pass" else reason)


def test_empty_missing_and_another_lesson_say_so(autograded):
    results = autograded["results"]
    name = source_for(LESSON).name
    empty = results["empty"]
    assert empty["score"] == 0 and empty["output"].startswith(f"Nothing was graded: {name} is empty.")
    assert all(t["output"] == f"{name} is empty" for t in empty["tests"])
    assert results["missing"]["output"].startswith("Nothing was graded: the submission holds no files.")
    wrong = results["wrong lesson"]
    said = f"{name} is lesson 00 (00_orientation.ipynb), not lesson {LESSON}: submit your {name}"
    assert wrong["score"] == 0 and said in wrong["output"] and "answers.pdf is not a notebook" in wrong["output"]
    assert all(said in t["output"] for t in wrong["tests"])


@pytest.mark.parametrize("case", ["hostile bwrap", "hostile setpriv"])
def test_a_submission_cannot_write_results_or_the_course(autograded, case):
    if case not in autograded["results"]:
        pytest.skip("no Python here that the user nobody can run, for the privilege drop")
    data, run, base = autograded["results"][case], autograded["runs"][case], autograded["bases"][case]
    # Its own cell asserted that it is not root and that every write failed: it would have failed the run.
    assert data["score"] == len(NAMES), data["output"]
    assert data["extra_data"]["isolation"] == case.split()[1]
    assert "Needs review by your instructor: frame inspection: sys._getframe" in data["output"]
    assert not (base / "results" / "forged.txt").exists()
    assert "999" not in (base / "results" / "results.json").read_text()
    assert run["after"] == run["before"], "the course's files changed"


def test_the_autograders_times(autograded):
    """Not a limit: the wall time of each run, printed for the README's instructor guide (machine load varies)."""
    for case, run in autograded["runs"].items():
        print(f"{case}: {run['seconds']:.1f} s")


def test_the_command_refuses_in_one_line(tmp_path, capsys):
    from course_utils.tooling.cli import main

    points = tmp_path / "points.toml"
    points.write_text("[points]\n")
    assert main(["autograder", "05", "06", "--points", str(points), "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err == "error: --points gives one lesson's points: build that lesson's autograder alone\n"
    assert main(["autograder", "99", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith("error: there is no lesson 99: the lessons are 00, 01")
    assert not list(tmp_path.glob("*.zip"))
