"""Whether a running JupyterLab has a notebook open, asked through its sessions API before `reset` or `restore` rewrite it.

A notebook rewritten on disk while its tab is open comes back with the next Ctrl-S in that tab:
JupyterLab asks whether to overwrite the file on disk, and Overwrite undoes the reset. So
`reset` and `restore` first ask every running Jupyter server whose root folder holds the
notebook (each one writes its URL and token to jpserver-<pid>.json in Jupyter's runtime folder)
for its sessions, `GET /api/sessions`, and refuse while one has the notebook open, unless told
`--force`. Where no server can be asked (none running here, one that does not answer, one
started elsewhere), they write, then give the same advice.
"""

import json
import os
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from course_utils.tooling.language import _
from course_utils.tooling.layout import CourseError, shown

ASK_SECONDS = 2.0


@dataclass
class Answer:
    """What the servers said: the URLs of those with the notebook open, and whether any could not be asked."""

    open_in: list[str] = field(default_factory=list)
    unknown: bool = False


def runtime_dir() -> Path:
    """Jupyter's runtime folder, where each running server leaves jpserver-<pid>.json."""
    try:
        from jupyter_core.paths import jupyter_runtime_dir
    except ImportError:
        return Path(os.environ.get("JUPYTER_RUNTIME_DIR", Path.home() / ".local" / "share" / "jupyter" / "runtime"))
    return Path(jupyter_runtime_dir())


def running_servers(folder: Path | None = None) -> list[dict]:
    """The servers whose runtime files name a process that still runs (a file left by a server that crashed is passed over)."""
    found = []
    for path in sorted((folder or runtime_dir()).glob("jpserver-*.json")):
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and _alive(info.get("pid")):
            found.append(info)
    return found


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True  # another user's process
    except OSError:
        return False
    return True


def _holds(info: dict, notebook: Path) -> bool:
    root = info.get("root_dir") or info.get("notebook_dir")
    return isinstance(root, str) and notebook.resolve().is_relative_to(Path(root).resolve())


def sessions(info: dict) -> list[dict]:
    """The server's sessions (GET /api/sessions with its token); raises OSError or ValueError when it cannot be asked."""
    url = str(info.get("url") or "")
    if not url.startswith("http") or info.get("sock"):
        raise OSError("no HTTP address to ask")
    request = urllib.request.Request(url.rstrip("/") + "/api/sessions", headers={"Authorization": f"token {info.get('token') or ''}"})
    with urllib.request.urlopen(request, timeout=ASK_SECONDS) as response:  # noqa: S310 -- the server's own URL
        found = json.loads(response.read().decode("utf-8"))
    if not isinstance(found, list):
        raise ValueError("not a list of sessions")
    return [s for s in found if isinstance(s, dict)]


def ask(notebook: Path, folder: Path | None = None) -> Answer:
    """Ask each running server whose root holds the notebook whether one of its sessions is that notebook."""
    answer = Answer()
    servers = [info for info in running_servers(folder) if _holds(info, notebook)]
    answer.unknown = not servers
    for info in servers:
        try:
            found = sessions(info)
        except (OSError, ValueError):
            answer.unknown = True
            continue
        root = Path(info.get("root_dir") or info.get("notebook_dir"))
        paths = [s.get("path") or (s.get("notebook") or {}).get("path") for s in found]
        if any(isinstance(p, str) and (root / p).resolve() == notebook.resolve() for p in paths):
            answer.open_in.append(str(info.get("url")))
    return answer


def reload_advice(notebook: Path, command: str) -> str:
    """What to do in a tab that may still show the notebook as it was."""
    return _("if {notebook} is open in JupyterLab, use File → Reload Notebook from Disk in its tab (or close it "
             "without saving): saving that tab would undo this {command}").format(notebook=shown(notebook), command=command)


class TabGuard:
    """Called by reset and restore just before they write: refuse while a JupyterLab tab has the notebook open (unless force).

    After writing, `advice` is the line to print (None when every server that could have the notebook said it has not).
    """

    def __init__(self, command: str, force: bool = False, folder: Path | None = None):
        self.command, self.force, self.folder = command, force, folder
        self.advice: str | None = None

    def __call__(self, notebook: Path) -> None:
        answer = ask(notebook, self.folder)
        if answer.open_in and not self.force:
            raise CourseError(_("{notebook} is open in JupyterLab ({url}): close its tab, then run "
                                "`{command}` again; or run it with --force, then use File → Reload Notebook from Disk in that tab").format(
                notebook=shown(notebook), url=answer.open_in[0], command=self.command))
        if answer.open_in or answer.unknown:
            self.advice = reload_advice(notebook, self.command.split()[0])
