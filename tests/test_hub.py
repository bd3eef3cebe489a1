"""The course on a JupyterHub, every step of the README's section tested here (without a hub).

- A student's own copy, brought into their home by an nbgitpuller link (nbgitpuller's own GitPuller,
  offline, on a file:// repository) or by `git clone`: their work in work/ survives a course update
  byte for byte, the new lesson appears in work/, and `reset` gives them the changed one.
- A read-only shared copy installed once by an admin, with the kernel the README registers: each
  student's work goes to their own COURSE_WORK_DIR (`${HOME}/pytorch-course-work`, which Jupyter
  fills in per user), and a student (the user nobody here) can write there and nowhere in the course.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest

from course_utils.tooling.layout import learner_path, root, source_for
from test_autograder import nobody_python

COURSE = root()
GIT = ["git", "-c", "user.name=course", "-c", "user.email=course@example.invalid"]
WORK_DIR = "${HOME}/pytorch-course-work"
OWN_COPY = "${HOME}/pytorch-course"
WHERE = "from course_utils.tooling.layout import root, work_dir; print(root(), work_dir())"


def lesson_files(lesson: str) -> list[Path]:
    return [source_for(lesson), learner_path(source_for(lesson))]


def make_course(folder: Path, lessons: list[str]) -> Path:
    """A git repository holding the course's package and tooling and the given lessons (source and learner copy)."""
    folder.mkdir(parents=True)
    for name in ("pyproject.toml", "constraints.txt", ".gitignore", "README.md", "LICENSE"):
        shutil.copy(COURSE / name, folder)
    shutil.copytree(COURSE / "course_utils", folder / "course_utils", ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "notebooks" / "solutions").mkdir(parents=True)
    for lesson in lessons:
        add_lesson(folder, lesson)
    commit(folder, "the course")
    return folder


def add_lesson(folder: Path, lesson: str) -> None:
    for path in lesson_files(lesson):
        shutil.copy(path, folder / path.relative_to(COURSE))


def commit(folder: Path, message: str) -> None:
    if not (folder / ".git").exists():
        subprocess.run(GIT + ["init", "-q", "-b", "main"], cwd=folder, check=True)
    subprocess.run(GIT + ["add", "-A"], cwd=folder, check=True)
    subprocess.run(GIT + ["commit", "-q", "-m", message], cwd=folder, check=True)


def change_lesson(folder: Path, lesson: str) -> None:
    """The course changes a lesson: a sentence added to its first cell, in the source and the learner copy alike."""
    for path in lesson_files(lesson):
        target = folder / path.relative_to(COURSE)
        nb = nbformat.read(target, as_version=4)
        nb.cells[0].source += "\n\nUpdated for this term."
        nbformat.write(nb, target)


def course_command(copy: Path, *args: str, env: dict | None = None, user: list[str] = ()) -> str:
    """`python -m course_utils ...` as a student runs it from their copy of the course."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(copy.parent), "PYTHONPATH": str(copy), "LANG": "C.UTF-8",
           "JUPYTER_RUNTIME_DIR": str(copy.parent / ".jupyter-runtime"), **(env or {})}
    python = [str(nobody_python())] if user else [sys.executable]
    run = subprocess.run([*user, *python, "-m", "course_utils", *args], cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def pull(how: str, url: str, target: Path) -> None:
    """Bring the course into target, or update it there: as an nbgitpuller link does, or with git."""
    if how == "nbgitpuller":
        from nbgitpuller.pull import GitPuller

        for _ in GitPuller(url, str(target), branch="main").pull():
            pass
    elif target.exists():
        subprocess.run(GIT + ["pull", "-q"], cwd=target, check=True)
    else:
        subprocess.run(["git", "clone", "-q", url, str(target)], check=True)


@pytest.mark.parametrize("how", ["git", "nbgitpuller"])
def test_a_course_update_keeps_the_students_work(tmp_path, how):
    if how == "nbgitpuller":
        pytest.importorskip("nbgitpuller", reason="nbgitpuller is in the test extra: pip install -e '.[test]'")
    upstream = make_course(tmp_path / "upstream", ["00", "01"])
    home = tmp_path / "home"
    home.mkdir()
    mine = home / "pytorch-course"
    pull(how, upstream.as_uri(), mine)
    assert "made 2 notebooks" in course_command(mine, "workspace")
    work = mine / "work"
    ours = nbformat.read(work / "01_tensors.ipynb", as_version=4)
    ours.cells.append(nbformat.v4.new_markdown_cell("My notes on strides."))
    nbformat.write(ours, work / "01_tensors.ipynb")
    (work / ".progress.json").write_text(json.dumps({"01": {"linear": {"status": "passed", "reason": "", "time": 1}}}))
    (work / "scratch.py").write_text("print('mine')\n")
    before = snapshot(work)
    old_01 = (work / "01_tensors.ipynb").read_bytes()

    add_lesson(upstream, "02")
    change_lesson(upstream, "01")
    commit(upstream, "lesson 02; lesson 01 updated")
    pull(how, upstream.as_uri(), mine)

    assert snapshot(work) == before  # every file of the student's, byte for byte
    if how == "nbgitpuller":  # the kernel the README registers for students' own copies: theirs, not the admin's
        register_kernel(tmp_path / "prefix", ("PYTHONPATH", OWN_COPY))
        assert kernel_says(tmp_path / "prefix", home, WHERE).split() == [str(mine), str(work)]
    assert "Updated for this term." in (mine / "notebooks" / "01_tensors.ipynb").read_text()
    assert "made 1 notebooks" in course_command(mine, "workspace")
    assert (work / "02_autograd.ipynb").read_bytes() == (mine / "notebooks" / "02_autograd.ipynb").read_bytes()
    assert (work / "01_tensors.ipynb").read_bytes() == old_01  # the changed lesson is theirs until they ask
    said = course_command(mine, "reset", "01")
    assert (work / "01_tensors.ipynb").read_bytes() == (mine / "notebooks" / "01_tensors.ipynb").read_bytes()
    backups = list((work / "backups").glob("01_tensors.*.ipynb"))
    assert len(backups) == 1 and backups[0].read_bytes() == old_01 and backups[0].name in said


def test_a_shared_read_only_course_with_each_students_work_in_their_home(tmp_path):
    if nobody_python() is None:
        pytest.skip("needs root, and a Python the user nobody can run, to act as a student")
    top = Path(tempfile.mkdtemp(prefix="course-hub-"))  # under /tmp, opened to nobody: pytest's own folder is root's
    try:
        os.chmod(top, 0o755)
        upstream = make_course(top / "upstream", ["00", "01"])
        shared = top / "opt" / "pytorch-course"
        subprocess.run(["git", "clone", "-q", upstream.as_uri(), str(shared)], check=True)
        subprocess.run(["chmod", "-R", "a+rX,go-w", str(top / "opt")], check=True)

        # The kernel the README registers: the course's Python, COURSE_WORK_DIR in each user's home.
        spec = register_kernel(top / "prefix", ("COURSE_WORK_DIR", WORK_DIR))
        assert spec["argv"][0] == sys.executable and spec["env"] == {"COURSE_WORK_DIR": WORK_DIR}
        student = top / "home" / "ada"
        student.mkdir(parents=True)
        os.chmod(top / "home", 0o755)
        shutil.chown(student, "nobody")
        # PYTHONPATH stands for the admin's editable install of the shared copy (this .venv's points at the tests' course).
        seen = kernel_says(top / "prefix", student, WHERE, PYTHONPATH=str(shared))
        assert seen.split() == [str(shared), str(student / "pytorch-course-work")]

        # The student makes their copies and works; the course stays as the admin left it.
        as_student = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
        env = {"HOME": str(student), "COURSE_WORK_DIR": str(student / "pytorch-course-work")}
        course_before = snapshot(shared)
        assert "made 2 notebooks" in course_command(shared, "workspace", env=env, user=as_student)
        work = student / "pytorch-course-work"
        assert work.stat().st_uid == (work / "01_tensors.ipynb").stat().st_uid != 0
        (work / "01_tensors.ipynb").write_text((work / "01_tensors.ipynb").read_text().replace("Lesson", "My lesson", 1))
        denied = subprocess.run([*as_student, "touch", str(shared / "notebooks" / "01_tensors.ipynb")], capture_output=True)
        assert denied.returncode != 0 and snapshot(shared) == course_before

        # The admin updates the course once for everyone; the student's work is untouched and the new lesson comes.
        before = snapshot(work)
        add_lesson(upstream, "02")
        commit(upstream, "lesson 02")
        subprocess.run(GIT + ["pull", "-q"], cwd=shared, check=True)
        assert "made 1 notebooks" in course_command(shared, "workspace", env=env, user=as_student)
        assert {k: v for k, v in snapshot(work).items() if k != "02_autograd.ipynb"} == before
    finally:
        shutil.rmtree(top, ignore_errors=True)


def register_kernel(prefix: Path, *env: tuple[str, str]) -> dict:
    """The README's `ipykernel install` of the course's kernel, into prefix instead of /usr/local; its kernel.json."""
    subprocess.run([sys.executable, "-m", "ipykernel", "install", "--prefix", str(prefix), "--name", "pytorch-course",
                    "--display-name", "PyTorch course", *[a for pair in env for a in ("--env", *pair)]],
                   check=True, capture_output=True)
    return json.loads((prefix / "share" / "jupyter" / "kernels" / "pytorch-course" / "kernel.json").read_text())


def kernel_says(prefix: Path, home: Path, code: str, **env: str) -> str:
    """Start the registered kernel as Jupyter would for a user whose HOME is home; what code prints in it."""
    from jupyter_client.manager import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    specs = KernelSpecManager(kernel_dirs=[str(prefix / "share" / "jupyter" / "kernels")])
    manager = KernelManager(kernel_name="pytorch-course", kernel_spec_manager=specs)
    manager.start_kernel(env={**os.environ, "HOME": str(home), **env})
    client = manager.client()
    client.start_channels()
    out = []
    try:
        client.wait_for_ready(timeout=120)
        client.execute_interactive(code, timeout=120, output_hook=lambda m: out.append(m["content"].get("text", "")))
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return "".join(out)
