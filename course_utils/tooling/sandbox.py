"""Running a submission's code in a bubblewrap (bwrap) sandbox, for the grader.

`command(argv, ...)` wraps a command line so that it runs:
- with the system, the Python install, the venv and the parts of the course the checker reads
  (course_utils/, notebooks/, data/) read-only at their usual paths, and nothing else of the machine;
- with one writable folder (the submission's workdir) and a private /tmp;
- in its own network (loopback only), PID, IPC and UTS namespaces, so it reaches no other
  machine and no process outside, and everything in it dies with its first process;
- with no capabilities, and only the environment it is given;
- graded by root: as the unprivileged user nobody; graded by a user: as that user, in a user
  namespace of its own (bwrap makes it) that cannot make further user namespaces.

`apply_limits(Limits())`, as Popen's preexec_fn, sets the resource limits that the sandbox inherits.
`problem()` says in one line why no sandbox can be made on this machine, or None.

Why nobody and not root: Linux never enforces RLIMIT_NPROC for the real root user (kernel/fork.c
exempts INIT_USER, capabilities or not), so a fork bomb run as root inside the sandbox would not be
stopped. bwrap starts as root (it needs to mount), then `setpriv` drops to nobody before argv runs.
A user (not root) cannot switch to nobody, and needs not: the kernel holds it to RLIMIT_NPROC.
"""

import functools
import os
import pwd
import resource
import shutil
import subprocess
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


def _as_root() -> bool:
    """Whether the grader runs as root: root's sandbox drops to nobody, a user's runs as that user."""
    return os.getuid() == 0


@functools.cache
def _supports(program: str, option: str) -> bool:
    """Whether this bwrap knows option, by its --help (--disable-userns came in bubblewrap 0.8.0)."""
    try:
        result = subprocess.run([program, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return option in result.stdout.split()


def problem() -> str | None:
    """Why no sandbox can be made on this machine, in one line; None when one can."""
    program = bwrap_path()
    if program is None:
        return "bubblewrap (bwrap) is not installed: it is needed to grade in a sandbox"
    return _probe(program, _as_root())


@functools.cache
def _probe(program: str, as_root: bool) -> str | None:
    """Run `true` in bwrap once, with the sandbox's namespaces: bwrap's own last error line and a hint if it fails."""
    argv = [program, *_namespaces(program, as_root), "--ro-bind", "/", "/", "--", "true"]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        return f"bwrap ({program}) could not be run: {err}"
    if result.returncode == 0:
        return None
    lines = [line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    said = lines[-1] if lines else f"it exited with status {result.returncode} and said nothing"
    return f"bwrap cannot make a sandbox on this machine ({said}); {_hint(as_root)}"


def _sysctl(name: str) -> str | None:
    """A kernel setting (as sysctl names it), or None where this kernel has no such setting."""
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return None


def _hint(as_root: bool) -> str:
    """What most likely stops bwrap here, and what to do about it."""
    if as_root:
        return "root's bwrap needs no user namespace, so namespaces as such are refused (a container without CAP_SYS_ADMIN?)"
    if _sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1":
        return ("AppArmor forbids user namespaces to unprivileged programs (kernel.apparmor_restrict_unprivileged_userns=1, "
                "Ubuntu 24.04+): give bwrap an AppArmor profile that allows userns, or run the grader as root")
    for name, value in (("user.max_user_namespaces", "0"), ("kernel.unprivileged_userns_clone", "0")):
        if _sysctl(name) == value:
            return f"user namespaces are switched off ({name}={value}): allow them, or run the grader as root"
    return ("a user's bwrap needs a user namespace (on Ubuntu 24.04+, an AppArmor profile for bwrap allows one), "
            "or run the grader as root")


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
    # RLIMIT_NPROC counts threads too; what else it counts depends on who grades (process_limit).
    # Lesson 07 peaked at 33 threads in all.
    processes: int = 512
    open_files: int = 1024
    file_size_mb: int = 256


def apply_limits(limits: Limits) -> None:
    """setrlimit on the current process (used as a preexec_fn, so the sandbox inherits them)."""
    for which, value in (
        (resource.RLIMIT_DATA, limits.memory_mb * MB),
        (resource.RLIMIT_NPROC, process_limit(limits.processes)),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_FSIZE, limits.file_size_mb * MB),
    ):
        hard = resource.getrlimit(which)[1]
        if hard != resource.RLIM_INFINITY and not _as_root():
            value = min(value, hard)  # a user cannot raise a hard limit (ValueError): the lower one holds
        resource.setrlimit(which, (value, value))


# What Linux counts against RLIMIT_NPROC (6.18, kernel/ucount.c): the tasks (threads included) of
# one uid in one user namespace, at every level from the task's namespace up to the initial one.
# At the task's own level the bound is its own RLIMIT_NPROC; at each level above, the RLIMIT_NPROC
# that the process which made the namespace below had then (bwrap: the grader's preexec_fn's).
# Measured as a user running 62 threads, in bwrap --unshare-user, with and without --disable-userns
# alike: RLIMIT_NPROC 40 set before bwrap: bwrap cannot make its namespace (EAGAIN); 40 set inside:
# 38 forks (bwrap's pid 1 and the forker make 40; the user's 62 outside do not count); 62 + 40 set
# before: 38 forks, but 8 when the user started 30 threads elsewhere meanwhile. Root's sandbox runs
# as nobody in the initial namespace: all of nobody's tasks on the machine count, at one level.
def process_limit(processes: int) -> int:
    """The RLIMIT_NPROC that apply_limits sets for Limits.processes, which depends on who sets it.

    - root (the grader's preexec_fn): `processes`. Root's sandbox runs as nobody, so this bounds every
      process and thread of nobody on the machine: sandboxes graded side by side share it (root
      itself is never held to RLIMIT_NPROC).
    - nobody (the checker in root's sandbox, where grade.py applies the limits again): `processes`,
      the same bound.
    - any other user: `processes` more than the threads of that user's processes that /proc shows
      now. As the grader's preexec_fn, before bwrap, /proc shows the user's whole machine (a desktop
      session may run hundreds of threads), and the kernel holds that whole count to this bound: the
      sandbox may start about `processes` processes and threads, fewer if the user's other programs
      start some meanwhile. Inside a user's sandbox, /proc and the kernel both count the sandbox's
      alone: it may start about `processes` more.
    """
    uid = os.getuid()
    if uid == 0 or uid == _sandbox_uid():
        return processes
    return threads_of(uid) + processes


def threads_of(uid: int) -> int:
    """How many threads the processes whose real uid is uid run, of those this process can see in /proc."""
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            text = Path("/proc", pid, "status").read_text()
        except OSError:
            continue  # it ended meanwhile
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid:
            count += int(fields["Threads"])
    return count


def _sandbox_ids() -> tuple[int, int]:
    entry = pwd.getpwnam(SANDBOX_USER)
    return entry.pw_uid, entry.pw_gid


def _sandbox_uid() -> int | None:
    """nobody's uid, or None on a system without one."""
    try:
        return _sandbox_ids()[0]
    except KeyError:
        return None


def _drop_privileges() -> list[str]:
    """setpriv, run as argv's parent: become nobody, with no capabilities left even in the bounding set."""
    uid, gid = _sandbox_ids()
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--"]


def _namespaces(program: str, as_root: bool) -> list[str]:
    # bwrap's pid 1 in the new PID namespace reaps until every process in it has exited, while the
    # outer bwrap returns as soon as argv's process exits. --die-with-parent kills pid 1 when the
    # outer bwrap ends (returns or is killed), and the kernel then kills every process left in the
    # namespace, even one in a session of its own. Without it a fork-hopper outlives bwrap (tested).
    return ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
            "--new-session",  # no terminal of the grader's to push keystrokes into (TIOCSTI)
            "--cap-drop", "ALL",
            *(_root_capabilities() if as_root else _user_namespace(program))]


def _root_capabilities() -> list[str]:
    # Only for setpriv to switch to nobody (and empty the bounding set); nobody keeps none.
    # No --unshare-user (so no --disable-userns, which needs it) for root's bwrap: the sandbox's uid
    # would map to root outside (uid_map "65534 0 1" with --uid 65534; setpriv cannot switch to an
    # unmapped nobody: tested), and the kernel never holds root to RLIMIT_NPROC (see above). So
    # nobody can still make a user namespace there (`unshare -U` works: tested), in which the
    # sandbox's mounts are locked and nobody's files stay nobody's; only a seccomp filter (bwrap
    # --seccomp) could forbid it.
    return ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]


def _user_namespace(program: str) -> list[str]:
    """A user's bwrap: a user namespace of its own (the caller's uid as itself), and none further where bwrap can forbid it."""
    # A user's bwrap makes one anyway (Debian's is not setuid); say so rather than rely on it.
    # In a user namespace of its own the submission would get every capability back, over its own
    # namespaces only, but with far more of the kernel in reach: --disable-userns (bwrap 0.8.0+)
    # sets user.max_user_namespaces to 1 and nests the sandbox one namespace deeper, so it cannot.
    return ["--unshare-user", *(["--disable-userns"] if _supports(program, "--disable-userns") else [])]


def _user_name(as_root: bool) -> str:
    """The name the sandbox runs under: nobody in root's, the caller's own (its uid where it has no name) in a user's."""
    if as_root:
        return SANDBOX_USER
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def _environment(env: Mapping[str, str], home: Path, user: str) -> list[str]:
    """--clearenv, then PATH and the locale (env may replace them), env, and HOME, TMPDIR and the user, which are the sandbox's."""
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
    """Create the mount points' parent folders world-readable: bwrap makes them 0700, so nobody (root's sandbox) could not
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


def _workdir(workdir: Path, as_root: bool) -> Path:
    """workdir and workdir/home, writable by the sandbox's user; returns home."""
    home = workdir / "home"
    home.mkdir(mode=0o700, exist_ok=True)
    if as_root:
        _give_to_nobody(workdir, home)
    # A user's sandbox runs as that user, whose workdir and home are already.
    return home


def _give_to_nobody(workdir: Path, home: Path) -> None:
    """Make workdir and home nobody's, for root's sandbox."""
    uid, gid = _sandbox_ids()
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

    Creates workdir/home (HOME inside); graded by root, gives workdir and home to nobody, whom the
    sandbox runs as; graded by a user, the sandbox runs as that user, whose workdir must be. The
    caller runs the result with Popen(..., preexec_fn=lambda: apply_limits(limits), pass_fds=keep_fds).
    RuntimeError (problem()'s line) where no sandbox can be made on this machine.
    """
    reason = problem()
    if reason is not None:
        raise RuntimeError(reason)
    program, as_root = bwrap_path(), _as_root()
    _check_fds(keep_fds)
    workdir = Path(workdir).resolve()
    home = _workdir(workdir, as_root)
    read_only = _read_only_paths()
    bound = [p for p in read_only if not p.is_symlink()]  # a symlink made in the sandbox is not a folder to go into
    return [
        program, *_namespaces(program, as_root), *_environment(env, home, _user_name(as_root)),
        # /tmp first, so that workdir's parents, if it lies in /tmp, are made in the private one.
        "--perms", "1777", "--tmpfs", "/tmp",
        *_parent_dirs([*read_only, workdir], bound),
        *[arg for path in read_only for arg in _read_only(path)],
        *_devices(),
        "--bind", str(workdir), str(workdir),
        *_hidden(hide, [*bound, workdir]),
        "--remount-ro", "/",  # the folders made above: nobody could not write them anyway, now no one can
        "--chdir", str(workdir),
        "--", *(_drop_privileges() if as_root else []), *argv,
    ]
