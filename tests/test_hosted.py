"""course_utils.hosted: the course set up in Colab or Kaggle, tested here without them.

The end-to-end test publishes a copy of the course as a git repository reached by a file:// URL
(set in the copy's pyproject.toml, the only input), builds lesson 00 there (which writes its set-up
cell), and runs the lesson from a fresh "hosted" start: a kernel of a new venv in which a fake
`google.colab` is imported at start-up and course_utils is not installed. The venv reads this
.venv's packages through a .pth line, so the runtime's own torch is reused (nothing is downloaded:
pip runs with PIP_NO_INDEX=1), as it would be in Colab when its torch is recent enough.
"""

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import nbformat
import pytest

from course_utils import hosted
from course_utils.tooling.layout import root, source_for
from test_autograder import venv_reusing_packages

COURSE = root()


def test_a_hosted_runtime_is_colab_or_kaggle(monkeypatch):
    monkeypatch.delenv(hosted.KAGGLE_VARIABLE, raising=False)
    assert hosted.hosted_runtime() is None
    monkeypatch.setenv(hosted.KAGGLE_VARIABLE, "Interactive")
    assert hosted.hosted_runtime() == "Kaggle"
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert hosted.hosted_runtime() == "Colab"


def test_version_tuples_ignore_local_labels():
    assert hosted.version_tuple("2.9.0+cu126") == (2, 9, 0)
    assert hosted.version_tuple("2.14.1") > hosted.version_tuple("2.9.1") >= hosted.version_tuple("2.9")
    assert hosted.version_tuple("2.15.0rc1") >= hosted.version_tuple("2.14")


def test_the_torch_plan_reuses_a_recent_torch_and_installs_the_pin_otherwise():
    assert hosted.torch_plan("2.14.1+cu126", "2.14", "2.14.1", "05") == (
        False, "torch 2.14.1+cu126: this runtime's own, recent enough for lesson 05 (it needs 2.14 or newer).")
    assert hosted.torch_plan("2.9.0+cu126", "2.14", "2.14.1", "05") == (
        True, "torch 2.14.1: the course's pinned version, installed because this runtime's 2.9.0+cu126 is older than lesson 05 needs (2.14).")
    assert hosted.torch_plan(None, "2.14", "2.14.1", "05")[1].endswith("installed because this runtime has no torch.")


def test_the_lesson_needs_its_stated_torch_else_the_pins_minor(tmp_path):
    (tmp_path / "notebooks" / "solutions").mkdir(parents=True)
    shutil.copy(COURSE / "constraints.txt", tmp_path)
    (tmp_path / "notebooks" / "solutions" / "05_x.ipynb").write_text(json.dumps({"metadata": {"course": {"min_torch": "2.6"}}, "cells": []}))
    (tmp_path / "notebooks" / "solutions" / "06_y.ipynb").write_text(json.dumps({"metadata": {}, "cells": []}))
    assert hosted.needed_torch("05", tmp_path) == "2.6"
    assert hosted.needed_torch("06", tmp_path) == ".".join(hosted.pins(COURSE)["torch"].split(".")[:2])


def test_set_up_installs_the_pin_and_only_what_is_missing(monkeypatch, tmp_path, capsys):
    calls = []
    have = {"torch": "2.9.0+cu126", "torchvision": "0.24.0", "nbval": None, "onnxscript": None}
    monkeypatch.setattr(hosted, "installed", lambda name: have.get(name, "1.0"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COURSE_WORK_DIR", "")  # recorded first, so that the test's end restores what was there before:
    monkeypatch.delenv("COURSE_WORK_DIR")  # set_up writes os.environ itself, behind monkeypatch's back
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as in a fresh runtime (restored after the test)
    def run(argv, check):
        calls.append(argv[argv.index("install") + 1:])
        return subprocess.CompletedProcess(argv, 0)

    lines = hosted.set_up("05", str(COURSE), run=run)
    pins = hosted.pins(COURSE)
    assert calls[0][-3:] == ["--no-build-isolation", "-e", str(COURSE)]
    assert calls[1][-4:] == [f"torch=={pins['torch']}", f"torchvision=={pins['torchvision']}", f"nbval=={pins['nbval']}",
                             f"onnxscript=={pins['onnxscript']}"]  # never numpy, pandas or matplotlib, which the runtime has
    assert lines[0].startswith(f"torch {pins['torch']}: the course's pinned version, installed because this runtime's 2.9.0+cu126")
    assert os.environ["COURSE_WORK_DIR"] == str(tmp_path) and f"{tmp_path}/.progress.json" in lines[-1]
    assert capsys.readouterr().out.splitlines() == lines


def published_course(folder: Path) -> str:
    """A copy of the course as a git repository with lesson 00 only, its URL set in pyproject.toml; returns the file:// URL."""
    folder.mkdir()
    for name in ("pyproject.toml", "constraints.txt", "README.md", "LICENSE"):
        shutil.copy(COURSE / name, folder)
    ignore = shutil.ignore_patterns("__pycache__", "fashion", ".*")
    shutil.copytree(COURSE / "course_utils", folder / "course_utils", ignore=ignore)
    shutil.copytree(COURSE / "data", folder / "data", ignore=ignore)
    (folder / "notebooks" / "solutions").mkdir(parents=True)
    shutil.copy(source_for("00"), folder / "notebooks" / "solutions")
    url = f"file://localhost{folder}"  # setuptools wants a host in project.urls; git takes file://localhost/ as file:///
    with open(folder / "pyproject.toml", "a") as f:
        f.write(f'\n[project.urls]\nRepository = "{url}"\n')
    env = {**os.environ, "PYTHONPATH": str(folder)}
    built = subprocess.run([sys.executable, "-m", "course_utils", "build", "00"], cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    git = ["git", "-c", "user.name=course", "-c", "user.email=course@example.invalid"]
    for command in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "the course"]):
        subprocess.run(git + command, cwd=folder, check=True, capture_output=True)
    return url


def test_a_lesson_runs_from_a_fresh_colab_start_with_only_the_repository_url(tmp_path):
    url = published_course(tmp_path / "published")
    runtime = venv_reusing_packages(tmp_path / "colab-venv", Path(sys._base_executable))
    python = runtime / "bin" / "python"
    assert subprocess.run([str(python), "-c", "import course_utils"], cwd=tmp_path, capture_output=True).returncode != 0  # not installed
    fake = tmp_path / "fake"
    (fake / "google" / "colab").mkdir(parents=True)  # `google` stays a namespace package: protobuf's google.protobuf still imports
    (fake / "google" / "colab" / "__init__.py").write_text('"""A stand-in for Colab\'s own module, imported as Colab imports it."""\n')
    startup = tmp_path / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-colab.py").write_text(f"import sys\nsys.path.append({str(fake)!r})\nimport google.colab\n")
    kernels = tmp_path / "jupyter" / "kernels" / "colab"
    kernels.mkdir(parents=True)
    (kernels / "kernel.json").write_text(json.dumps({"argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                                                     "display_name": "Colab stand-in", "language": "python"}))
    content = tmp_path / "content"  # Colab's working folder; the notebook comes from the repository, as its badge opens it
    content.mkdir()
    (content / "00_orientation.ipynb").write_bytes((tmp_path / "published" / "notebooks" / "solutions" / "00_orientation.ipynb").read_bytes())
    (tmp_path / "home").mkdir()
    env = {"PATH": f"{runtime}/bin:/usr/bin:/bin", "HOME": str(tmp_path / "home"), "IPYTHONDIR": str(tmp_path / "ipython"),
           "JUPYTER_PATH": str(tmp_path / "jupyter"), "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "PYTHONNOUSERSITE": "1", "MPLBACKEND": "Agg", "LANG": "C.UTF-8"}
    runner = ("import nbformat\nfrom nbclient import NotebookClient\n"
              "nb = nbformat.read('00_orientation.ipynb', as_version=4)\n"
              "NotebookClient(nb, timeout=300, kernel_name='colab', resources={'metadata': {'path': '.'}}).execute()\n"
              "nbformat.write(nb, 'ran.ipynb')\n")
    packages = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir())
    before = {p: p.read_bytes() for p in packages.glob("__editable__*course_utils*")}
    assert before
    ran = subprocess.run([str(python), "-c", runner], cwd=content, env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    nb = nbformat.read(content / "ran.ipynb", as_version=4)
    setup = next(c for c in nb.cells if "hosted-setup" in c.metadata.get("tags", []))
    assert url in setup.source
    said = "".join(o.get("text", "") for o in setup.outputs if o.get("name") == "stdout")
    torch_version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('torch'))"], cwd=tmp_path,
                                   capture_output=True, text=True).stdout.strip()
    assert next(line for line in said.splitlines() if line.startswith("torch ")) == f"torch {torch_version}: this runtime's own, recent enough for lesson 00 (it needs 2.14 or newer)."
    assert f"your progress is kept in {content}/.progress.json until this runtime ends" in said
    assert (content / "published" / "course_utils").is_dir()  # cloned beside the notebook
    records = json.loads((content / ".progress.json").read_text())
    assert {name: r["status"] for name, r in records["00"].items()} == {"add_one": "passed", "draw": "passed"}
    gpu = next(c for c in nb.cells if "gpu" in c.metadata.get("tags", []))
    assert "".join(o.get("text", "") for o in gpu.outputs).strip()  # the gpu cell ran: here, it says why it steps aside
    assert {p: p.read_bytes() for p in before} == before  # the course's own .venv was not touched


def test_set_up_falls_back_to_an_isolated_build_and_says_in_one_line_when_pip_fails(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COURSE_WORK_DIR", str(tmp_path))
    calls = []

    def run(argv, check):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 1)

    with pytest.raises(hosted.SetUpFailed, match=r"^`pip install --no-deps -e .*` failed \(exit 1\): pip says why just above$"):
        hosted.set_up("05", str(COURSE), run=run)
    assert ["--no-build-isolation" in argv for argv in calls] == [True, False]
