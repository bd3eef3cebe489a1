"""The grader's sandbox: what a submission can see, write, reach and leave behind, and that the checker still runs in it."""

import contextlib
import errno
import hashlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from course_utils.tooling import sandbox
from course_utils.tooling.layout import root
from course_utils.tooling.sandbox import Limits, apply_limits, bwrap_path, command

if bwrap_path() is None:
    pytest.skip("bubblewrap (bwrap) is not installed, or this is not Linux: no sandbox to test", allow_module_level=True)

# The course under test, not an editable install elsewhere, must be what the sandbox imports.
COURSE_ENV = {"PYTHONPATH": str(root())}


@pytest.fixture
def workdir():
    """A submission's folder as the grader makes it: mkdtemp (mode 0700) in /tmp."""
    with tempfile.TemporaryDirectory(prefix="course-grade-") as folder:
        yield Path(folder)


def run(argv: list[str], workdir: Path, *, env: dict | None = None, hide=(), keep_fds=(), limits: Limits = Limits(),
        timeout: float = 120) -> subprocess.CompletedProcess:
    """argv in the sandbox, as the grader runs it; stdout and stderr as text."""
    line = command(argv, workdir=workdir, env={**COURSE_ENV, **(env or {})}, hide=hide, keep_fds=keep_fds)
    return subprocess.run(line, preexec_fn=lambda: apply_limits(limits), pass_fds=keep_fds, capture_output=True,
                          text=True, timeout=timeout)


def python(code: str, workdir: Path, *args: str, **options) -> subprocess.CompletedProcess:
    """Python code in the sandbox; fails the test with its stderr if it does not exit 0."""
    result = run([sys.executable, "-c", textwrap.dedent(code), *args], workdir, **options)
    assert result.returncode == 0, result.stderr
    return result


def with_marker(marker: str) -> list[int]:
    """Pids of the processes (outside or in any sandbox) whose command line holds marker."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def wait_for(condition, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---------------------------------------------------------------- what it can see

READ_ALL = """
    import json, sys
    seen = {}
    for path in sys.argv[1:]:
        try:
            with open(path, "rb") as f:
                seen[path] = f.read().decode(errors="replace")
        except OSError as err:
            seen[path] = type(err).__name__
    print(json.dumps(seen))
"""


def read_inside(paths: list[Path], workdir: Path, **options) -> dict[str, str]:
    return json.loads(python(READ_ALL, workdir, *map(str, paths), **options).stdout)


def test_files_outside_what_is_bound_cannot_be_read(tmp_path, workdir):
    classmate = tmp_path / "classmate.ipynb"
    classmate.write_text("CLASSMATE'S ANSWERS")
    course_secrets = [p for p in (root() / ".git", root() / "README.md", root() / "tests" / "conftest.py") if p.exists()]
    allowed = root() / "notebooks" / "00_orientation.ipynb"
    seen = read_inside([classmate, *course_secrets, Path("/etc/shadow"), Path("/etc/hostname"), allowed], workdir)
    assert seen.pop(str(allowed)).startswith("{"), "the course's notebooks must stay readable"
    assert course_secrets, "no file of the course folder outside what the checker needs to try"
    assert set(seen.values()) <= {"FileNotFoundError", "PermissionError"}, seen


def test_hidden_paths_under_a_bound_folder_are_masked(workdir):
    submissions, out = workdir / "submissions", workdir / "grades.csv"
    submissions.mkdir()
    (submissions / "alice.ipynb").write_text("ALICE'S ANSWERS")
    out.write_text("bob,00,pass")
    listing = python("import os, sys; print(os.listdir(sys.argv[1]))", workdir, str(submissions), hide=[submissions, out])
    assert listing.stdout.strip() == "[]"
    seen = read_inside([submissions / "alice.ipynb", out], workdir, hide=[submissions, out])
    # A file is masked by /dev/null, bound without device access (nodev): it cannot even be opened.
    assert seen == {str(submissions / "alice.ipynb"): "FileNotFoundError", str(out): "PermissionError"}
    # The control: without hide, the same files are there to read.
    assert read_inside([out], workdir) == {str(out): "bob,00,pass"}


def test_hidden_paths_that_do_not_exist_or_are_not_bound_are_left_out(tmp_path, workdir):
    outside = tmp_path / "grades.csv"
    outside.write_text("x")
    line = command(["true"], workdir=workdir, env={}, hide=[tmp_path / "missing", outside])
    assert str(tmp_path / "missing") not in line and str(outside) not in line


def test_only_the_listed_paths_are_bound(workdir):
    line = command(["true"], workdir=workdir, env={})
    sources = {line[i + 1] for i, arg in enumerate(line) if arg in ("--bind", "--ro-bind", "--dev-bind")}
    writable = {line[i + 1] for i, arg in enumerate(line) if arg in ("--bind", "--dev-bind") and not line[i + 1].startswith("/dev/")}
    assert writable == {str(workdir.resolve())}
    assert "/" not in sources and "/etc" not in sources and str(root()) not in sources
    assert {str(root() / p) for p in ("course_utils", "notebooks", "data")} <= sources
    assert not any(s.startswith(str(root() / ".git")) or s.startswith(str(root() / "work")) for s in sources)


# ---------------------------------------------------------------- who it runs as, with what environment

def test_environment_and_identity(monkeypatch, workdir):
    monkeypatch.setenv("COURSE_GRADER_SECRET", "s3cret")
    code = """
        import json, os, pathlib
        status = dict(line.split(":\\t", 1) for line in pathlib.Path("/proc/self/status").read_text().splitlines())
        namespaces = {n: os.readlink(f"/proc/self/ns/{n}") for n in ("pid", "net", "ipc", "uts", "mnt")}
        print(json.dumps({"env": dict(os.environ), "uid": os.getuid(), "cwd": os.getcwd(), "ns": namespaces,
                          "caps": [status[k].strip() for k in ("CapEff", "CapBnd")], "nnp": status["NoNewPrivs"].strip()}))
    """
    seen = json.loads(python(code, workdir, env={"COURSE_CHECK_MODE": "1", "HOME": "/root", "USER": "root"}).stdout)
    shared = [n for n, link in seen["ns"].items() if os.readlink(f"/proc/self/ns/{n}") == link]
    assert not shared, f"namespaces shared with the grader: {shared}"
    env = seen["env"]
    assert "COURSE_GRADER_SECRET" not in env and "s3cret" not in json.dumps(env)
    assert env["COURSE_CHECK_MODE"] == "1"
    assert env["HOME"] == str(workdir.resolve() / "home") and (workdir / "home").is_dir()
    assert (env["USER"], env["LOGNAME"], env["TMPDIR"], env["LC_ALL"]) == ("nobody", "nobody", "/tmp", "C.UTF-8")
    assert seen["cwd"] == str(workdir.resolve())
    assert seen["uid"] == sandbox._sandbox_ids()[0] != 0
    assert seen["caps"] == ["0000000000000000", "0000000000000000"] and seen["nnp"] == "1"


# ---------------------------------------------------------------- what it can write

WRITE_ALL = """
    import json, sys
    result = {}
    for path in sys.argv[1:]:
        try:
            with open(path, "a") as f:
                f.write("written in the sandbox")
            result[path] = "ok"
        except OSError as err:
            result[path] = type(err).__name__
    print(json.dumps(result))
"""


MOUNTS = """
    import json
    # /proc/self/mountinfo: field 5 is the mount point, field 6 its options (ro or rw first).
    print(json.dumps({f[4]: f[5].split(",")[0] for f in map(str.split, open("/proc/self/mountinfo"))}))
"""


def test_everything_bound_is_read_only_but_workdir_and_tmp(workdir):
    mounts = json.loads(python(MOUNTS, workdir).stdout)
    read_only = [root() / "course_utils", root() / "notebooks", root() / "data", Path(sys.prefix).resolve(),
                 Path(sys.base_prefix).resolve(), Path("/usr"), Path("/etc/passwd")]
    assert {str(p): mounts.get(str(p)) for p in read_only} == {str(p): "ro" for p in read_only}
    assert [mounts[p] for p in (str(workdir.resolve()), "/tmp", "/dev/shm")] == ["rw"] * 3
    writable = {point for point, mode in mounts.items() if mode == "rw" and point.split("/")[1] not in ("dev", "proc")}
    assert writable == {str(workdir.resolve()), "/tmp"}
    assert mounts["/"] == "ro"


def test_only_workdir_and_tmp_are_writable(tmp_path, workdir):
    lesson = root() / "course_utils" / "lesson00.py"
    before = hashlib.sha256(lesson.read_bytes()).hexdigest()
    sibling = tmp_path / "beside-workdir.txt"
    targets = [lesson, root() / "notebooks" / "new.ipynb", Path(sys.prefix) / "planted.py", Path("/usr/planted"),
               sibling, workdir / "out.txt", workdir / "home" / ".rc", Path("/tmp/scratch"), Path("/dev/shm/x")]
    result = json.loads(python(WRITE_ALL, workdir, *map(str, targets)).stdout)
    assert [result[str(t)] for t in targets[5:]] == ["ok"] * 4
    assert all(result[str(t)] != "ok" for t in targets[:5]), result
    assert hashlib.sha256(lesson.read_bytes()).hexdigest() == before
    assert not (root() / "notebooks" / "new.ipynb").exists() and not sibling.exists()
    assert (workdir / "out.txt").read_text() == "written in the sandbox"
    assert not Path("/tmp/scratch").exists() or Path("/tmp/scratch").read_text() != "written in the sandbox"


# ---------------------------------------------------------------- what it can reach

@pytest.fixture
def host_server():
    """A TCP server outside the sandbox on every address of this machine; yields its port."""
    server = socket.create_server(("0.0.0.0", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                server.accept()[0].close()
            except TimeoutError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


def host_address() -> str | None:
    """This machine's address on its default route (no packet is sent), or None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.255", 9))
            return probe.getsockname()[0]
        except OSError:
            return None


NETWORK = """
    import json, socket, sys, threading
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: server.accept()[0].sendall(b"pong"), daemon=True).start()
    with socket.create_connection(server.getsockname(), timeout=5) as client:
        loopback = client.recv(4).decode()
    outside = {}
    for host in sys.argv[2:]:
        try:
            socket.create_connection((host, int(sys.argv[1])), timeout=3).close()
            outside[host] = "connected"
        except OSError as err:
            outside[host] = type(err).__name__
    print(json.dumps({"loopback": loopback, "outside": outside}))
"""


def test_loopback_works_and_nothing_else_is_reachable(host_server, workdir):
    address = host_address()
    hosts = ["127.0.0.1", *([address] if address and not address.startswith("127.") else []), "1.1.1.1"]
    # The control: outside the sandbox the host's server answers on its addresses.
    for host in hosts[:-1]:
        socket.create_connection((host, host_server), timeout=3).close()
    seen = json.loads(python(NETWORK, workdir, str(host_server), *hosts).stdout)
    assert seen["loopback"] == "pong"
    assert "connected" not in seen["outside"].values(), seen["outside"]
    assert seen["outside"]["127.0.0.1"] == "ConnectionRefusedError"  # its own loopback, where nothing listens


# ---------------------------------------------------------------- what it leaves behind

HOPPER = "import os, time\nwhile True:\n    if os.fork(): os._exit(0)\n    time.sleep(0.005)\n"

DRIVER = f"""
import subprocess, sys
marker = sys.argv[1]
subprocess.Popen([sys.executable, "-c", {HOPPER!r}, marker + "-hopper"])
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker + "-setsid"], start_new_session=True)
print("ready", flush=True)
sys.stdin.read()
"""


def start_escapers(workdir: Path, marker: str) -> subprocess.Popen:
    """The driver, its fork-hopper and its setsid sleeper running in a sandbox, checked to be visible from here."""
    line = command([sys.executable, "-c", DRIVER, marker], workdir=workdir, env=COURSE_ENV)
    proc = subprocess.Popen(line, preexec_fn=lambda: apply_limits(Limits()), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    # The control: the scan does see them while the sandbox runs.
    assert wait_for(lambda: with_marker(f"{marker}-hopper") and with_marker(f"{marker}-setsid"))
    return proc


def gone(marker: str) -> bool:
    return wait_for(lambda: not with_marker(f"{marker}-hopper") and not with_marker(f"{marker}-setsid"), 5)


def kill_all(find) -> None:
    """SIGKILL the processes find() names until none is left (a fork-hopper changes pid)."""
    for _ in range(50):
        pids = find()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


@pytest.fixture
def marker():
    """A unique word for this test's processes; any still running at the end (the test failed) are killed."""
    word = f"escaper-{uuid.uuid4().hex}"
    yield word
    kill_all(lambda: with_marker(word))


def test_nothing_outlives_the_first_process(workdir, marker):
    proc = start_escapers(workdir, marker)
    proc.stdin.close()  # the driver exits
    assert proc.wait(30) == 0
    assert gone(marker), with_marker(marker)


def test_nothing_outlives_a_killed_sandbox(workdir, marker):
    proc = start_escapers(workdir, marker)
    proc.send_signal(signal.SIGKILL)  # bwrap itself, as the grader's stop() does
    proc.wait(30)
    assert gone(marker), with_marker(marker)


def test_processes_outside_are_invisible(workdir):
    marker = f"outside-{uuid.uuid4().hex}"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    try:
        assert wait_for(lambda: with_marker(marker))
        code = """
            import pathlib, sys
            cmdlines = [p.read_bytes() for p in pathlib.Path("/proc").glob("[0-9]*/cmdline")]
            print(len(cmdlines), any(sys.argv[1][::-1].encode() in c for c in cmdlines))
        """
        count, seen = python(code, workdir, marker[::-1]).stdout.split()  # reversed: not in its own argv
        assert seen == "False" and int(count) < 10
    finally:
        sleeper.kill()
        sleeper.wait()


# ---------------------------------------------------------------- limits and descriptors

def test_limits_apply_inside(workdir):
    limits = Limits(memory_mb=1024, processes=30, open_files=77, file_size_mb=1)
    code = """
        import json, os, resource, time
        result = {"nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "data": resource.getrlimit(resource.RLIMIT_DATA)[0]}
        try:
            with open("big", "wb") as f:
                f.write(b"x" * (2 << 20))
        except OSError as err:
            result["write"] = err.errno
        try:
            blob = bytearray(1200 << 20)
        except MemoryError:
            result["alloc"] = "MemoryError"
        children = []
        try:
            for _ in range(60):
                pid = os.fork()
                if pid == 0:
                    time.sleep(2)
                    os._exit(0)
                children.append(pid)
        except OSError as err:
            result["fork"] = [len(children), err.errno]
        print(json.dumps(result))
    """
    seen = json.loads(python(code, workdir, limits=limits).stdout)
    assert seen["nofile"] == 77 and seen["data"] == 1024 << 20
    assert seen["write"] == errno.EFBIG and (workdir / "big").stat().st_size == 1 << 20
    assert seen["alloc"] == "MemoryError"
    assert seen["fork"][1] == errno.EAGAIN and seen["fork"][0] < 30, seen  # a fork bomb stops at the limit


def test_apply_limits_sets_each_limit():
    code = ("import resource, sys; from course_utils.tooling.sandbox import Limits, apply_limits\n"
            "apply_limits(Limits(memory_mb=3000, processes=99, open_files=88, file_size_mb=7))\n"
            "print([resource.getrlimit(getattr(resource, n)) for n in ('RLIMIT_DATA', 'RLIMIT_NPROC', 'RLIMIT_NOFILE', 'RLIMIT_FSIZE')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **COURSE_ENV}, check=True).stdout
    assert out.strip() == str([(3000 << 20,) * 2, (99, 99), (88, 88), (7 << 20,) * 2])


def test_a_kept_pipe_carries_the_result_out(workdir):
    read_end, write_end = os.pipe()
    try:
        result = run([sys.executable, "-c", "import os, sys; os.write(int(sys.argv[1]), b'{\"result\": 42}')", str(write_end)],
                     workdir, keep_fds=[write_end])
        os.close(write_end)
        write_end = None
        assert result.returncode == 0, result.stderr
        assert os.read(read_end, 100) == b'{"result": 42}'
    finally:
        os.close(read_end)
        if write_end is not None:
            os.close(write_end)


def test_keep_fds_refuses_what_cannot_be_passed(workdir):
    read_end, write_end = os.pipe()
    os.close(read_end)
    os.close(write_end)
    with pytest.raises(OSError):
        command(["true"], workdir=workdir, env={}, keep_fds=[write_end])
    with pytest.raises(ValueError):
        command(["true"], workdir=workdir, env={}, keep_fds=[1])


# ---------------------------------------------------------------- the course runs in it

def test_torch_and_course_utils_import(workdir):
    code = "import torch, course_utils; print(torch.ones(2).sum().item(), course_utils.__file__)"
    total, where = python(code, workdir).stdout.split()
    assert total == "2.0" and where == str(root() / "course_utils" / "__init__.py")


def checker(notebook: Path, workdir: Path) -> dict:
    """The course's checker, as the grader runs it, on a copy of notebook in workdir; its JSON report."""
    copy = workdir / notebook.name
    shutil.copyfile(notebook, copy)
    report = workdir / "report.json"
    argv = [sys.executable, "-m", "pytest", "-p", "course_utils.tooling.lean_imports", "--nbval-lax", "--nbval-current-env",
            "-q", "-p", "no:cacheprovider", "--course-report", str(report), str(copy)]
    result = run(argv, workdir, env={"COURSE_CHECK_MODE": "1"}, timeout=400)
    assert report.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    (notebook_report,) = json.loads(report.read_text()).values()
    return notebook_report


@pytest.mark.slow
def test_the_checker_runs_a_learner_copy(workdir):
    report = checker(root() / "notebooks" / "00_orientation.ipynb", workdir)
    statuses = {name: verdict["status"] for name, verdict in report["exercises"].items()}
    assert statuses and set(statuses.values()) == {"not attempted"}, report


@pytest.mark.slow
def test_the_heaviest_lesson_passes_under_the_default_limits(workdir):
    report = checker(root() / "notebooks" / "solutions" / "07_compile.ipynb", workdir)
    statuses = {name: verdict["status"] for name, verdict in report["exercises"].items()}
    assert statuses and set(statuses.values()) == {"passed"}, report


def test_no_bwrap_elsewhere(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert bwrap_path() is None


# ---------------------------------------------------------------- why no sandbox can be made here

def test_problem_is_none_where_bwrap_works():
    assert sandbox.problem() is None


def fake_bwrap(folder: Path, said: str) -> Path:
    """A bwrap on PATH that says `said` on stderr and exits 1, and logs each command line it gets."""
    program = folder / "bwrap"
    program.write_text(f'#!/bin/sh\necho "$*" >> "{folder}/calls"\necho "{said}" >&2\nexit 1\n')
    program.chmod(0o755)
    return program


@pytest.mark.parametrize(("settings", "hint"), [
    ({"kernel.apparmor_restrict_unprivileged_userns": "1"}, "(kernel.apparmor_restrict_unprivileged_userns=1, Ubuntu 24.04+)"),
    ({"user.max_user_namespaces": "0"}, "user namespaces are switched off (user.max_user_namespaces=0)"),
    ({}, "an AppArmor profile for bwrap"),
])
def test_problem_says_bwraps_own_error_and_a_hint(tmp_path, monkeypatch, settings, hint):
    said = "bwrap: setting up uid map: Permission denied"
    program = fake_bwrap(tmp_path, said)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(sandbox, "_as_root", lambda: False)
    monkeypatch.setattr(sandbox, "_sysctl", settings.get)
    assert bwrap_path() == str(program)
    reason = sandbox.problem()
    assert reason is not None and "\n" not in reason
    assert said in reason and hint in reason and "run the grader as root" in reason
    with pytest.raises(RuntimeError, match="setting up uid map"):
        command(["true"], workdir=tmp_path, env={})
    probes = [call for call in (tmp_path / "calls").read_text().splitlines() if call.endswith("-- true")]
    assert len(probes) == 1, "bwrap is tried once, then its answer is kept"
    assert not (tmp_path / "home").exists(), "nothing is made for a sandbox that cannot be"


def test_problem_reports_a_real_refusal():
    """bwrap run in a user namespace that maps no uid cannot make its own: a refusal from the real bwrap."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-U", "true"]).returncode != 0:
        pytest.skip("unshare -U is not available here to make a user namespace bwrap cannot work in")
    code = "from course_utils.tooling import sandbox; print(sandbox.problem())"
    out = subprocess.run(["unshare", "-U", sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **COURSE_ENV}, check=True).stdout.strip()
    assert out.startswith("bwrap cannot make a sandbox on this machine (bwrap: "), out
    assert "run the grader as root" in out and len(out.splitlines()) == 1


# ---------------------------------------------------------------- graded by a user, not root

def option_pairs(line: list[str]) -> set[tuple[str, str]]:
    return set(zip(line, line[1:]))


def test_a_users_line_has_no_setpriv_and_a_user_namespace(monkeypatch, workdir):
    owner = workdir.stat().st_uid
    monkeypatch.setattr(sandbox, "_as_root", lambda: False)
    line = command(["true"], workdir=workdir, env={})
    assert "setpriv" not in line and "--cap-add" not in line
    assert "--unshare-user" in line and ("--cap-drop", "ALL") in option_pairs(line)
    has_option = "--disable-userns" in subprocess.run([line[0], "--help"], capture_output=True, text=True).stdout
    assert ("--disable-userns" in line) == has_option
    assert line[line.index("--", line.index("--chdir")) + 1:] == ["true"]
    assert (workdir.stat().st_uid, (workdir / "home").stat().st_uid) == (owner, os.getuid()), "nothing is chowned"
    assert ("--setenv", "USER") in option_pairs(line)
    assert line[line.index("USER") + 1] == pwd.getpwuid(os.getuid()).pw_name


def test_roots_line_drops_to_nobody(monkeypatch, workdir):
    if os.getuid() != 0:
        pytest.skip("only root can give the workdir to nobody")
    line = command(["true"], workdir=workdir, env={})
    assert line[line.index("--", line.index("--chdir")) + 1] == "setpriv" and "--unshare-user" not in line
    assert {("--cap-add", c) for c in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")} <= option_pairs(line)
    assert workdir.stat().st_uid == sandbox._sandbox_ids()[0]


# ---------------------------------------------------------------- a user's sandbox, for real

# The venv's Python lies under /root (0700): another user runs the system's. sandbox.py needs only the standard library.
SYSTEM_PYTHON = "/usr/bin/python3"
ADMIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# The grader, as a user runs it: argv in the sandbox, limits set before bwrap (or not at all); a JSON report.
USER_GRADER = """
import json, subprocess, sys
from pathlib import Path
from course_utils.tooling import sandbox
spec = json.loads(sys.argv[1])
line = sandbox.command(spec["argv"], workdir=Path(spec["workdir"]), env=spec["env"])
limits = sandbox.Limits(processes=spec["processes"] or 512)
before = (lambda: sandbox.apply_limits(limits)) if spec["processes"] else None
result = subprocess.run(line, preexec_fn=before, capture_output=True, text=True, timeout=120)
print(json.dumps({"line": line, "returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr}))
"""


def system_python_problem() -> str | None:
    """Why the system's Python cannot run sandbox.py as another user, or None."""
    if not Path(SYSTEM_PYTHON).exists():
        return f"{SYSTEM_PYTHON} is not installed"
    version = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info >= (3, 10))"],
                             capture_output=True, text=True).stdout.strip()
    if version != "True":
        return f"{SYSTEM_PYTHON} is older than 3.10, which sandbox.py needs"
    closed = [p for p in root().parents if not p.stat().st_mode & 0o001]
    return f"{closed[0]} is closed to other users, so they cannot import the course" if closed else None


def processes_of(uid: int) -> list[int]:
    """Pids of the processes whose real uid is uid."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if int((entry / "status").read_text().split("\nUid:\t", 1)[1].split()[0]) == uid:
                found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def grader_user():
    """A throwaway ordinary user to grade as (useradd, then userdel with its processes killed); its passwd entry."""
    if os.getuid() != 0:
        pytest.skip("grading as another user needs root to switch to it (and to make it): run as root to test a user's sandbox")
    missing = [tool for tool in ("useradd", "userdel", "setpriv") if shutil.which(tool, path=ADMIN_PATH) is None]
    if missing or system_python_problem():
        pytest.skip(f"cannot grade as another user here: {', '.join(missing) + ' missing' if missing else system_python_problem()}")
    name = f"csbx{uuid.uuid4().hex[:10]}"
    made = subprocess.run([shutil.which("useradd", path=ADMIN_PATH), "--system", "--user-group", "--no-create-home",
                           "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"useradd could not make a user to grade as: {made.stderr.strip()}")
    user = pwd.getpwnam(name)
    try:
        yield user
    finally:
        kill_all(lambda: processes_of(user.pw_uid))
        subprocess.run([shutil.which("userdel", path=ADMIN_PATH), name], check=True)


def as_user(user, argv: list[str]) -> list[str]:
    return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups", *argv]


@pytest.fixture
def user_workdir(grader_user, workdir):
    """A submission's folder as a user's grader makes it: mkdtemp (0700), the user's own."""
    os.chown(workdir, grader_user.pw_uid, grader_user.pw_gid)
    return workdir


def grade_as(user, argv: list[str], workdir: Path, *, processes: int | None = None, env: dict | None = None) -> dict:
    """argv in a sandbox made by `user`'s grader (the system's Python), whose own environment holds a secret."""
    spec = {"argv": argv, "workdir": str(workdir), "processes": processes, "env": env or {}}
    grader = subprocess.run(as_user(user, [SYSTEM_PYTHON, "-c", USER_GRADER, json.dumps(spec)]), capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root()), "COURSE_GRADER_SECRET": "s3cret"},
                            cwd="/", timeout=180)
    assert grader.returncode == 0, grader.stderr
    return json.loads(grader.stdout)


def in_user_sandbox(user, code: str, workdir: Path, *args: str, **options) -> str:
    """Python code (the system's) in `user`'s sandbox; its stdout, or the test fails with its stderr."""
    report = grade_as(user, [SYSTEM_PYTHON, "-c", textwrap.dedent(code), *args], workdir, **options)
    assert report["returncode"] == 0, report["stderr"]
    return report["stdout"]


USER_INSIDE = """
    import errno, json, os, subprocess, sys
    status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines())
    result = {"id": subprocess.run(["id", "-u"], capture_output=True, text=True).stdout.strip(), "env": dict(os.environ),
              "caps": [status[k].strip() for k in ("CapEff", "CapBnd")], "nnp": status["NoNewPrivs"].strip(),
              "unshare": subprocess.run(["unshare", "-U", "true"], capture_output=True, text=True).returncode}
    for name, path in (("workdir", "out.txt"), ("course", sys.argv[1])):
        try:
            with open(path, "a") as f:
                f.write("written in the sandbox")
            result[name] = "ok"
        except OSError as err:
            result[name] = errno.errorcode[err.errno]
    print(json.dumps(result))
"""


def test_a_users_sandbox_runs_as_that_user_and_keeps_the_rest_out(grader_user, user_workdir):
    uid = grader_user.pw_uid
    # A course file the user may write outside: inside, the course is read-only all the same.
    course_file = root() / "notebooks" / f".sandbox-test-{uuid.uuid4().hex}"
    course_file.write_text("")
    os.chown(course_file, uid, grader_user.pw_gid)
    try:
        assert subprocess.run(as_user(grader_user, ["sh", "-c", f"echo >> {course_file}"])).returncode == 0  # the control
        assert subprocess.run(as_user(grader_user, ["unshare", "-U", "true"])).returncode == 0  # the control
        seen = json.loads(in_user_sandbox(grader_user, USER_INSIDE, user_workdir, str(course_file)))
        assert course_file.read_text() == "\n"
    finally:
        course_file.unlink()
    assert seen["id"] == str(uid)
    env = seen["env"]
    assert "COURSE_GRADER_SECRET" not in env and "s3cret" not in json.dumps(env)
    assert (env["USER"], env["HOME"]) == (grader_user.pw_name, str(user_workdir.resolve() / "home"))
    assert seen["workdir"] == "ok" and (user_workdir / "out.txt").read_text() == "written in the sandbox"
    assert seen["course"] == "EROFS"
    assert seen["caps"] == ["0000000000000000", "0000000000000000"] and seen["nnp"] == "1"
    assert seen["unshare"] != 0, "--disable-userns: no user namespace of its own inside"
    assert (user_workdir.stat().st_uid, (user_workdir / "home").stat().st_uid) == (uid, uid)


def test_a_users_line_is_a_users(grader_user, user_workdir):
    line = grade_as(grader_user, ["true"], user_workdir)["line"]
    assert "setpriv" not in line and "--cap-add" not in line and {"--unshare-user", "--disable-userns"} <= set(line)


def test_a_users_sandbox_reaches_only_its_loopback(grader_user, user_workdir, host_server):
    address = host_address()
    hosts = ["127.0.0.1", *([address] if address and not address.startswith("127.") else []), "1.1.1.1"]
    for host in hosts[:-1]:  # the control: the user reaches the host's server outside the sandbox
        code = f"import socket; socket.create_connection(({host!r}, {host_server}), timeout=3).close()"
        assert subprocess.run(as_user(grader_user, [SYSTEM_PYTHON, "-c", code])).returncode == 0
    seen = json.loads(in_user_sandbox(grader_user, NETWORK, user_workdir, str(host_server), *hosts))
    assert seen["loopback"] == "pong"
    assert "connected" not in seen["outside"].values(), seen["outside"]


USER_ESCAPERS = f"""
import pathlib, subprocess, sys, time
marker = sys.argv[1]
subprocess.Popen([sys.executable, "-c", {HOPPER!r}, marker + "-hopper"])
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker + "-setsid"], start_new_session=True)
def cmdline(p):
    try:
        return p.read_bytes()
    except OSError:
        return b""
def seen():
    cmdlines = [cmdline(p) for p in pathlib.Path("/proc").glob("[0-9]*/cmdline")]
    return [kind for kind in ("hopper", "setsid") if any((marker + "-" + kind).encode() in c for c in cmdlines)]
# the hopper takes a new pid every 5 ms, so one scan of /proc can miss it: look again until both are seen
deadline, found = time.monotonic() + 20, seen()
while len(found) < 2 and time.monotonic() < deadline:
    time.sleep(0.1)
    found = sorted(set(found) | set(seen()))
print(" ".join(found))
"""


def test_nothing_outlives_a_users_sandbox(grader_user, user_workdir, marker):
    report = grade_as(grader_user, [SYSTEM_PYTHON, "-c", USER_ESCAPERS, marker], user_workdir)
    assert report["returncode"] == 0, report["stderr"]
    assert report["stdout"].split() == ["hopper", "setsid"], "the control: both ran in the sandbox"
    assert gone(marker), with_marker(marker)


FORKS = """
    import errno, json, os, sys, time
    if len(sys.argv) > 1:  # as grade.py does: the limits set again inside
        sys.path.insert(0, sys.argv[1])
        from course_utils.tooling.sandbox import Limits, apply_limits
        apply_limits(Limits(processes=int(sys.argv[2])))
    forks = 0
    try:
        for _ in range(200):
            if os.fork() == 0:
                time.sleep(3)
                os._exit(0)
            forks += 1
    except OSError as err:
        print(json.dumps([forks, errno.errorcode[err.errno]]))
    else:
        print(json.dumps([forks, None]))
"""

CROWD = "import threading, time\nfor _ in range(200): threading.Thread(target=time.sleep, args=(120,), daemon=True).start()\nprint('up', flush=True)\ntime.sleep(120)"


@pytest.mark.parametrize("where", ["before bwrap", "inside"])
def test_a_users_sandbox_may_start_its_processes_however_many_the_user_runs(grader_user, user_workdir, where):
    crowd = subprocess.Popen(as_user(grader_user, [SYSTEM_PYTHON, "-c", CROWD]), stdout=subprocess.PIPE, text=True)
    try:
        assert crowd.stdout.readline().strip() == "up"
        assert sandbox.threads_of(grader_user.pw_uid) > 200  # the control: the user runs far more than 30
        args = [] if where == "before bwrap" else [str(root()), "30"]
        out = in_user_sandbox(grader_user, FORKS, user_workdir, *args, processes=30 if where == "before bwrap" else None)
    finally:
        crowd.kill()
        crowd.wait()
    forks, error = json.loads(out)
    assert error == "EAGAIN" and 20 <= forks <= 30, (forks, error)  # 30 more than now, less bwrap's own before it
