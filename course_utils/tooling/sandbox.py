"""Running a submission's code in a bubblewrap (bwrap) sandbox, for the grader.

`command(argv, ...)` wraps a command line so that it runs:
- with the system, the Python install, the venv and the parts of the course the checker reads
  (course_utils/, notebooks/, data/) read-only at their usual paths, and nothing else of the machine;
- with one writable folder (the submission's workdir) and a private /tmp;
- in its own network (loopback only), PID, IPC and UTS namespaces, so it reaches no other
  machine and no process outside, and everything in it dies with its first process;
- as the unprivileged user nobody, with no capabilities, and only the environment it is given.

`apply_limits(Limits())`, as Popen's preexec_fn, sets the resource limits that the sandbox inherits.

Why nobody and not root: Linux never enforces RLIMIT_NPROC for the real root user (kernel/fork.c
exempts INIT_USER, capabilities or not), so a fork bomb run as root inside the sandbox would not be
stopped. bwrap starts as root (it needs to mount), then `setpriv` drops to nobody before argv runs.
"""

import os
import pwd
import resource
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SANDBOX_USER = "nobody"
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# What a Python, torch or Jupyter process reads in /etc: users (getpass, ~), name lookup of
# localhost, the dynamic linker, time zone, TLS certificates, fonts (matplotlib), alternatives
# (/usr/bin links through them), MIME types and service names (the standard library).
ETC_PATHS = (
    "passwd", "group", "hosts", "host.conf", "nsswitch.conf", "gai.conf", "ld.so.cache", "ld.so.conf",
    "ld.so.conf.d", "localtime", "timezone", "ssl/certs", "ssl/openssl.cnf", "ca-certificates", "fonts",
    "alternatives", "mime.types", "protocols", "services", "os-release",
)
# What the checker reads in the course folder: the package, the lessons' source notebooks, the data.
# Not pyproject.toml: pytest looks for its config upwards from the notebook, which lies in workdir.
COURSE_PATHS = ("course_utils", "notebooks", "data")
GPU_DEVICES = ("/dev/nvidia*", "/dev/dri")
MB = 1024 * 1024


def bwrap_path() -> str | None:
    """The bwrap program, or None where it is not installed."""
    if not sys.platform.startswith("linux"):
        return None
    return shutil.which("bwrap")


@dataclass(frozen=True)
class Limits:
    """Per-process resource limits inside the sandbox (setrlimit); an instructor can change each."""

    # RLIMIT_DATA (private writable memory, VmData), not RLIMIT_AS (address space, VmPeak). Measured
    # on lesson 07's solution copy (torch + torch.compile), sampled every 0.2 s: the kernel peaked at
    # VmPeak 4867 MB but VmData 1275 MB (RSS 1213 MB), a C++ compiler it ran at VmData 527 MB. Under
    # RLIMIT_AS = 4096 MB that lesson fails at its 4th cell (torch cannot allocate 4 MB). CUDA is
    # known to reserve tens of GB of address space (PROT_NONE, which VmData does not count; not
    # measured here, this machine has no GPU).
    # 4096 MB of data is three times the peak measured: every lesson's checks pass under it.
    memory_mb: int = 4096
    # RLIMIT_NPROC counts threads too, of every process of the sandbox's user (nobody) on the
    # machine, so sandboxes graded side by side share it: lesson 07 peaked at 33 threads in all.
    processes: int = 512
    open_files: int = 1024
    file_size_mb: int = 256


def apply_limits(limits: Limits) -> None:
    """setrlimit on the current process (used as a preexec_fn, so the sandbox inherits them)."""
    for which, value in (
        (resource.RLIMIT_DATA, limits.memory_mb * MB),
        (resource.RLIMIT_NPROC, limits.processes),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_FSIZE, limits.file_size_mb * MB),
    ):
        resource.setrlimit(which, (value, value))


def _sandbox_ids() -> tuple[int, int]:
    entry = pwd.getpwnam(SANDBOX_USER)
    return entry.pw_uid, entry.pw_gid


def _drop_privileges() -> list[str]:
    """setpriv, run as argv's parent: become nobody, with no capabilities left even in the bounding set."""
    uid, gid = _sandbox_ids()
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--"]


def _namespaces() -> list[str]:
    # bwrap's pid 1 in the new PID namespace reaps until every process in it has exited, while the
    # outer bwrap returns as soon as argv's process exits. --die-with-parent kills pid 1 when the
    # outer bwrap ends (returns or is killed), and the kernel then kills every process left in the
    # namespace, even one in a session of its own. Without it a fork-hopper outlives bwrap (tested).
    return ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
            "--new-session",  # no terminal of the grader's to push keystrokes into (TIOCSTI)
            "--cap-drop", "ALL",
            # Only for setpriv to switch to nobody (and empty the bounding set); nobody keeps none.
            "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]


def _environment(env: Mapping[str, str], home: Path) -> list[str]:
    """--clearenv, then PATH and the locale (env may replace them), env, and HOME, TMPDIR and the user, which are the sandbox's."""
    user = SANDBOX_USER
    values = {"PATH": f"{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
              **env, "HOME": str(home), "TMPDIR": "/tmp", "USER": user, "LOGNAME": user}
    args = ["--clearenv"]
    for name, value in values.items():
        args += ["--setenv", name, value]
    return args


def _read_only(path: Path) -> list[str]:
    """Show path read-only at the same place; a symlink stays a symlink (as /lib -> usr/lib)."""
    if path.is_symlink():
        return ["--symlink", os.readlink(path), str(path)]
    return ["--ro-bind", str(path), str(path)]


def _aliases(path: Path) -> list[Path]:
    """A folder as Python names it (sys.path, sys.prefix) and as it really is, if a symlink lies between."""
    return [Path(os.path.abspath(path)), Path(path).resolve()]


def _course_root() -> Path:
    """The folder holding course_utils/, as the import system found it (the editable install's path)."""
    import course_utils

    return Path(course_utils.__file__).parent.parent


def _read_only_paths() -> list[Path]:
    """Everything shown read-only: the system, the needed /etc files, the Python install, the venv, the course's parts."""
    paths = [Path(p) for p in SYSTEM_PATHS]
    paths += [Path("/etc", p) for p in ETC_PATHS]
    paths += [*_aliases(Path(sys.base_prefix)), *_aliases(Path(sys.prefix))]
    paths += [folder / p for folder in _aliases(_course_root()) for p in COURSE_PATHS]
    return [p for p in dict.fromkeys(paths) if p.is_symlink() or p.exists()]


def _under(path: Path, folders: Sequence[Path]) -> bool:
    return any(path == f or f in path.parents for f in folders)


def _parent_dirs(mounts: Sequence[Path], bound: Sequence[Path]) -> list[str]:
    """Create the mount points' parent folders world-readable: bwrap makes them 0700, so nobody could not
    reach /root/.pyenv/... or workdir otherwise. Folders inside a read-only bind exist already."""
    parents = {a for m in mounts for a in m.parents if a not in (Path("/"), Path("/tmp")) and not _under(a, bound)}
    args = []
    for folder in sorted(parents, key=lambda p: len(p.parts)):
        args += ["--perms", "0755", "--dir", str(folder)]
    return args


def _devices() -> list[str]:
    """/proc and a minimal /dev, a writable /dev/shm (DataLoader workers), and the GPUs where there are any."""
    args = ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/dev/shm"]
    for device in sorted(p for pattern in GPU_DEVICES for p in Path("/").glob(pattern.lstrip("/"))):
        args += ["--dev-bind", str(device), str(device)]
    return args


def _hidden(paths: Sequence[Path], visible: Sequence[Path]) -> list[str]:
    """Mask each path that would be visible: a folder by an empty tmpfs, a file by /dev/null."""
    args = []
    for path in (Path(p).resolve() for p in paths):
        if not path.exists() or not _under(path, visible):
            continue  # nothing to see inside: only what is bound is visible
        args += ["--tmpfs", str(path)] if path.is_dir() else ["--ro-bind", "/dev/null", str(path)]
    return args


def _workdir(workdir: Path) -> Path:
    """workdir and workdir/home, owned by the sandbox's user so that it can write there; returns home."""
    uid, gid = _sandbox_ids()
    home = workdir / "home"
    home.mkdir(mode=0o700, exist_ok=True)
    os.chown(home, uid, gid)
    # bwrap enters workdir (--chdir) as root without capabilities, so root's group keeps access:
    # a mkdtemp folder (0700) given to nobody alone would stop it with "Permission denied".
    os.chown(workdir, uid, 0)
    os.chmod(workdir, 0o770)
    return home


def _check_fds(fds: Sequence[int]) -> None:
    """bwrap and setpriv close no inherited descriptor, so Popen(pass_fds=...) is all a caller needs; check they are usable."""
    for fd in fds:
        if fd <= 2:
            raise ValueError(f"file descriptor {fd} is stdin, stdout or stderr, not one to keep")
        os.fstat(fd)  # OSError (EBADF) when it is not open here, so it could not be passed


def command(argv: list[str], *, workdir: Path, env: Mapping[str, str], hide: Sequence[Path] = (),
            keep_fds: Sequence[int] = ()) -> list[str]:
    """The bwrap command line that runs argv in a sandbox: read-only system, Python and course; writable workdir and /tmp.

    Creates workdir/home (HOME inside) and gives workdir and home to the sandbox's user. The
    caller runs the result with Popen(..., preexec_fn=lambda: apply_limits(limits), pass_fds=keep_fds).
    """
    program = bwrap_path()
    if program is None:
        raise RuntimeError("bubblewrap (bwrap) is not installed: it is needed to grade in a sandbox")
    _check_fds(keep_fds)
    workdir = Path(workdir).resolve()
    home = _workdir(workdir)
    read_only = _read_only_paths()
    bound = [p for p in read_only if not p.is_symlink()]  # a symlink made in the sandbox is not a folder to go into
    return [
        program, *_namespaces(), *_environment(env, home),
        # /tmp first, so that workdir's parents, if it lies in /tmp, are made in the private one.
        "--perms", "1777", "--tmpfs", "/tmp",
        *_parent_dirs([*read_only, workdir], bound),
        *[arg for path in read_only for arg in _read_only(path)],
        *_devices(),
        "--bind", str(workdir), str(workdir),
        *_hidden(hide, [*bound, workdir]),
        "--remount-ro", "/",  # the folders made above: nobody could not write them anyway, now no one can
        "--chdir", str(workdir),
        "--", *_drop_privileges(), *argv,
    ]
