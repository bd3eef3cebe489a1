"""The Makefile's set-up: what `make lab` and `make test` run for each PyTorch build, told without installing anything (`make -n`).

PyTorch's CPU-only index cannot be reached from the machines the tests run on, so the
TORCH=cpu install itself is not run here: these tests check its commands, and that the
course's pin `torch==2.14.1` admits that index's `2.14.1+cpu`.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def make(*args: str, venv: Path) -> subprocess.CompletedProcess:
    # make test runs with COURSE_LANG=en, which make would take for `make lab COURSE_LANG=en`
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE") and k != "COURSE_LANG"}
    return subprocess.run(["make", "--no-print-directory", f"VENV={venv}", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)


def pip_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if " -m pip install" in line]


def test_the_first_install_states_its_download_and_shows_pips_progress(tmp_path):
    run = make("-n", "-B", f"{tmp_path}/v/.installed", venv=tmp_path / "v")
    assert run.returncode == 0, run.stderr
    said = next(line for line in run.stdout.splitlines() if line.startswith("echo \"Installing the course's pinned packages"))
    assert "over 3 GB to download on Linux x86_64" in said and "run make clean-venv, then make " in said and "TORCH=cpu" in said
    pip = pip_lines(run.stdout)
    assert pip[-1] == f"{tmp_path}/v/bin/python -m pip install --no-compile -c constraints.txt -e ."  # no --quiet: pip's own progress
    after = run.stdout.split(pip[-1], 1)[1].splitlines()[1]
    assert after.startswith(f"{tmp_path}/v/bin/python -m compileall -qq -j 0 ")  # the bytecode, compiled on every core
    assert not [line for line in pip if CPU_INDEX in line]


def test_torch_cpu_installs_the_same_pins_from_pytorchs_cpu_index_first(tmp_path):
    run = make("-n", "-B", f"{tmp_path}/v/.installed", "TORCH=cpu", venv=tmp_path / "v")
    assert run.returncode == 0, run.stderr
    python = f"{tmp_path}/v/bin/python"
    assert pip_lines(run.stdout)[-2:] == [
        f"{python} -m pip install --no-deps --no-compile --index-url {CPU_INDEX} -c constraints.txt torch torchvision",
        f"{python} -m pip install --no-compile -c constraints.txt -e .",  # finds torch==2.14.1 satisfied by 2.14.1+cpu: no CUDA libraries
    ]
    assert f"echo cpu > {tmp_path}/v/.torch" in run.stdout
    assert "2.5 GB less to download" in run.stdout


def test_the_pins_admit_the_cpu_wheels_local_version():
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line)
    for name in ("torch", "torchvision"):
        assert SpecifierSet(f"=={pins[name]}").contains(f"{pins[name]}+cpu")


def set_up_venv(tmp_path) -> Path:
    """A .venv whose set-up is done: its stamp newer than pyproject.toml and constraints.txt."""
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(shutil.which("python3") or "/usr/bin/python3")
    (venv / ".torch").write_text("cpu\n")
    stamp = venv / ".installed"
    stamp.touch()
    later = time.time() + 60
    os.utime(stamp, (later, later))
    return venv


def test_later_runs_install_nothing(tmp_path):
    venv = set_up_venv(tmp_path)
    run = make("-n", "lab", venv=venv)
    assert run.returncode == 0, run.stderr
    assert not pip_lines(run.stdout) and "Installing" not in run.stdout
    assert re.search(r"-m course_utils lab\s*$", run.stdout)


def test_make_lab_passes_the_courses_language_on_and_never_reads_lang(tmp_path):
    venv = set_up_venv(tmp_path)
    assert re.search(r"-m course_utils lab --lang zh\s*$", make("-n", "lab", "COURSE_LANG=zh", venv=venv).stdout)
    assert re.search(r"-m course_utils lab\s*$", make("-n", "lab", "LANG=zh_CN.UTF-8", venv=venv).stdout)


def test_another_build_than_the_venvs_needs_a_clean_venv_and_an_unknown_one_is_refused(tmp_path):
    venv = tmp_path / "v"
    venv.mkdir()
    (venv / ".torch").write_text("pypi\n")
    run = make("check-python", "TORCH=cpu", venv=venv)
    assert run.returncode != 0
    assert f"error: {venv} has PyTorch's pypi build, not TORCH=cpu: run `make clean-venv`, then `make check-python TORCH=cpu`." in run.stdout
    run = make(f"{tmp_path}/w/.installed", "TORCH=gpu", venv=tmp_path / "w")
    assert run.returncode != 0
    assert "error: TORCH=gpu: give TORCH=pypi (PyPI's PyTorch) or TORCH=cpu (PyTorch's CPU-only wheels)" in run.stdout
    assert not (tmp_path / "w").exists()  # refused before a venv was made


def test_make_test_runs_every_lesson_strictly_in_a_process_per_core_and_fails_one_that_leaves_a_process(tmp_path):
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(shutil.which("python3") or "/usr/bin/python3")
    (venv / ".torch").write_text("pypi\n")
    later = time.time() + 60
    for stamp in (venv / ".installed", venv / ".installed-test"):
        stamp.touch()
        os.utime(stamp, (later, later))
    run = make("-n", "test", venv=venv)
    assert run.returncode == 0, run.stderr
    (command,) = [line for line in run.stdout.splitlines() if " -m pytest " in line]
    for part in ("tests notebooks/solutions", "--nbval ", "--course-strict-warnings", "--course-no-leftovers", "--dist loadfile"):
        assert part in command, command
    jobs = int(re.search(r" -n (\d+) ", command).group(1))
    assert 1 <= jobs <= min(4, os.cpu_count() or 1)
    (one_by_one,) = [line for line in make("-n", "test", "TEST_JOBS=0", venv=venv).stdout.splitlines() if " -m pytest " in line]
    assert " -n " not in one_by_one and "--dist" not in one_by_one


def test_make_test_installs_the_test_extra_in_the_same_pip_run(tmp_path):
    run = make("-n", "-B", "test", venv=tmp_path / "v")
    assert run.returncode == 0, run.stderr
    installs = [line for line in pip_lines(run.stdout) if "-e " in line and line.startswith(f"{tmp_path}/v/bin/python")]
    assert installs == [f'{tmp_path}/v/bin/python -m pip install --no-compile -c constraints.txt -e ".[test]"']
    assert f'echo "[test]" > {tmp_path}/v/.extras' in run.stdout


@pytest.mark.parametrize("extras, adds_it", [("[test]\n", False), ("\n", True), (None, True)],
                         ids=["installed with the course", "after make lab", "a venv from before .extras"])
def test_the_test_set_up_adds_the_extra_only_when_it_is_missing(tmp_path, extras, adds_it):
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "python.log"
    # a stand-in that records the installs it is asked for and runs the rest (make's checks of the venv)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\ncase "$*" in *"pip install"*) echo "$@" >> {log};; *) exec {sys.executable} "$@";; esac\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".torch").write_text("pypi\n")
    if extras is not None:
        (venv / ".extras").write_text(extras)
    stamp = venv / ".installed"
    stamp.touch()
    later = time.time() + 60
    os.utime(stamp, (later, later))
    run = make(f"{venv}/.installed-test", venv=venv)
    assert run.returncode == 0, run.stdout + run.stderr
    asked = log.read_text() if log.exists() else ""
    assert ('-m pip install --quiet -c constraints.txt -e .[test]' in asked) == adds_it, asked
    assert (venv / ".installed-test").exists()
