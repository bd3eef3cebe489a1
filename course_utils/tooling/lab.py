"""`python -m course_utils lab`: JupyterLab as the course wants it, whatever the learner's own settings.

- the learner's copies in work/ are made first (never overwritten), and the URL JupyterLab
  prints opens lesson 00 in work/, not the Launcher;
- JupyterLab's root is the course folder, so its file browser shows README.md, data/ and work/;
- the settings in the course's .jupyter/ folder apply on top of JupyterLab's defaults (no
  news pop-up, no update check); the learner's own settings in ~/.jupyter are left alone and still win;
- a terminal opened in JupyterLab finds the course's python, jupyter and torchrun first on its PATH;
- as root (containers), --allow-root is added, since Jupyter refuses to start as root without it.
"""

import os
import subprocess
import sys
from pathlib import Path

from course_utils.tooling.layout import root, source_for, work_path

FIRST_LESSON = "00"


def lab_root() -> Path:
    """JupyterLab's root folder: the course folder, or the work folder's parent when COURSE_WORK_DIR puts it elsewhere."""
    lesson = work_path(source_for(FIRST_LESSON)).resolve()
    course = root().resolve()
    return course if lesson.is_relative_to(course) else lesson.parent.parent


def first_lesson_url() -> str:
    """The URL path (below JupyterLab's root) that opens the learner's copy of lesson 00."""
    lesson = work_path(source_for(FIRST_LESSON)).resolve()
    return "/lab/tree/" + lesson.relative_to(lab_root()).as_posix()


def lab_command(extra: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The `jupyter lab` command line and environment the course starts with."""
    extra = list(extra or [])
    command = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={lab_root()}",
               f"--LabApp.default_url={first_lesson_url()}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-root" not in extra:
        command.append("--allow-root")
    env = dict(os.environ)
    settings = str(root() / ".jupyter")
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(p for p in (settings, env.get("JUPYTER_CONFIG_PATH")) if p)
    env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.executable).parent), env.get("PATH")) if p)
    return command + extra, env


def main(extra: list[str] | None = None) -> int:
    """Make the learner's copies that are missing, then run JupyterLab on lesson 00 until it is stopped."""
    from course_utils.tooling.layout import shown, work_dir
    from course_utils.tooling.workspace import ensure_workspace

    made = ensure_workspace()
    if made:
        print(f"made your copies of {len(made)} lessons in {shown(work_dir())}")
    command, env = lab_command(extra)
    print(f"starting JupyterLab on {shown(work_path(source_for(FIRST_LESSON)))}; open the link it prints below (it ends in a token)",
          flush=True)
    if os.name == "posix":
        os.execve(sys.executable, command, env)  # Ctrl-C and signals go straight to JupyterLab
    return subprocess.call(command, env=env)
