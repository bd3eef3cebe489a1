"""JupyterLab as a learner meets it: a real server, headless Chromium, every lesson's untouched copy run through the UI.

Needs Debian's `chromium` and the `playwright` package (the `test` extra); skipped, with
the reason, where either is missing. CI installs both (.ci/run, make test).
"""

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import psutil
import pytest

from course_utils.tooling.publish import SETUP_TAG

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "build" / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ALL_SOURCES = sorted((ROOT / "notebooks" / "solutions").glob("[0-9][0-9]_*.ipynb"))
# What the browser adds to Run All is JupyterLab's front end, the same for every lesson and edition, so one lesson shows
# it: the Chinese edition's lesson 00 (test_run_all_of_a_chinese_lesson_shows_its_verdicts_in_chinese), whose kernel
# must also learn its notebook's language from Jupyter Server; its screenshot is kept. The English lesson 00 is opened in
# the browser by test_the_printed_url_opens_lesson_00 and worked through by test_a_broken_cell_unsaved_work_and_a_reset_
# beside_the_open_tab, and run as Run All does, in a plain kernel, by tests/test_notebooks.py (00 and 11, and the Chinese
# 00). COURSE_BROWSER_LESSONS="all" (or "01 05") runs English lessons through the UI too.
BROWSER_LESSONS = os.environ.get("COURSE_BROWSER_LESSONS", "").split()
SOURCES = [s for s in ALL_SOURCES if "all" in BROWSER_LESSONS or s.name[:2] in BROWSER_LESSONS]

playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[test])")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (Debian: apt-get install chromium)"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module's tests (playwright's sync API allows one at a time per thread)."""
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-quic"],
        )
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory, browser):
    """A JupyterLab server on localhost, serving untouched copies of the learner notebooks; no process outlives it."""
    folder = tmp_path_factory.mktemp("lab")
    # Copies, since the UI may autosave, which must not touch the repository.
    for source in SOURCES:
        shutil.copy(ROOT / "notebooks" / source.name, folder / source.name)
    (folder / "zh-CN").mkdir()
    shutil.copy(ROOT / "notebooks" / "zh-CN" / ZH_LESSON, folder / "zh-CN" / ZH_LESSON)
    port, token = free_port(), secrets.token_hex(16)
    command = [
        sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
        f"--ServerApp.token={token}", f"--ServerApp.root_dir={folder}", "--ServerApp.open_browser=False",
        "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if os.geteuid() == 0:
        command.append("--allow-root")
    # Render every cell (JupyterLab 4 otherwise keeps off-screen cells out of the page), and
    # keep the user's own settings and workspaces out of the test.
    settings = folder / ".settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    # A learner's JupyterLab is not the checker: the kernels must not inherit the test run's COURSE_CHECKER=1,
    # nor make test's COURSE_LANG=en: each kernel speaks its notebook's language, as in a learner's JupyterLab.
    env = {k: v for k, v in os.environ.items() if k not in ("COURSE_CHECKER", "COURSE_CHECK_MODE", "PYTEST_ADDOPTS", "COURSE_LANG")}
    env |= {"JUPYTERLAB_SETTINGS_DIR": str(folder / ".settings"), "JUPYTERLAB_WORKSPACES_DIR": str(folder / ".workspaces")}
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"JupyterLab did not start: {server.stderr.read().decode()[-2000:]}")
            time.sleep(0.5)
    tracked = [psutil.Process(server.pid)]
    try:
        yield {"url": url, "token": token, "dir": folder, "tracked": tracked, "browser": browser}
    finally:
        tracked += [c for c in tracked[0].children(recursive=True)]
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        gone, alive = psutil.wait_procs(tracked, timeout=10)
        for proc in alive:
            proc.kill()
        assert not alive, f"processes left behind by JupyterLab: {[p.pid for p in alive]}"


@pytest.mark.parametrize("source", SOURCES, ids=[s.stem for s in SOURCES])
def test_run_all_runs_every_cell_of_an_untouched_lesson(lab, source):
    """Run → Run All Cells on a learner copy: every cell runs, each check shows its TODO line, the scoreboard ends it."""
    saved, verdicts, scoreboards = run_all(lab, source.name, source.stem)
    exercises = [t.split(":", 1)[1] for c in saved.cells for t in c.metadata.get("tags", []) if t.startswith("check:")]
    shown = [v for v in verdicts if not any(v in s for s in scoreboards)]
    assert [v.split()[:2] for v in verdicts[: len(exercises)]] == [["TODO", f"{n}:"] for n in exercises], verdicts
    assert all("not attempted yet" in v for v in verdicts[: len(exercises)]), shown
    assert len(scoreboards) == 1 and f"{len(exercises)} exercises: 0 passed, {len(exercises)} not attempted" in scoreboards[0]


ZH_LESSON = "00_orientation.ipynb"


def test_run_all_of_a_chinese_lesson_shows_its_verdicts_in_chinese(lab):
    """The Chinese edition's lesson 00 through JupyterLab's UI: its kernel, told its notebook by Jupyter Server, speaks Chinese."""
    saved, verdicts, scoreboards = run_all(lab, f"zh-CN/{ZH_LESSON}", "zh-00")
    exercises = [t.split(":", 1)[1] for c in saved.cells for t in c.metadata.get("tags", []) if t.startswith("check:")]
    assert [v.split()[:2] for v in verdicts[: len(exercises)]] == [["TODO", f"{n}:"] for n in exercises], verdicts
    assert all("尚未作答" in v for v in verdicts[: len(exercises)]), verdicts
    assert len(scoreboards) == 1 and f"共 {len(exercises)} 个练习：0 个通过，{len(exercises)} 个未作答" in scoreboards[0]


def run_all(lab, name: str, stem: str):
    """Run → Run All Cells on the notebook `name` (below the lab's folder), then save it: (the saved notebook, its
    verdict lines, its scoreboards). Fails unless every cell ran and none raised."""
    tracked = lab["tracked"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = lab["browser"].new_page(viewport={"width": 1400, "height": 1000})
    try:
        # A workspace of its own, so that no notebook of an earlier test is open beside this one.
        page.goto(f"{lab['url']}/lab/workspaces/{stem}/tree/{name}?reset&token={lab['token']}")
        page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
        start_kernel(page)
        tracked += psutil.Process(tracked[0].pid).children(recursive=True)
        assert page.locator(".jp-OutputArea-output").count() == 0
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        n_code = sum(c.cell_type == "code" for c in nbformat.read(lab["dir"] / name, as_version=4).cells)
        page.wait_for_function(
            """n => {
                const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(e => e.textContent.trim());
                return prompts.length === n && prompts.every(t => /^\\[\\d+\\]:$/.test(t));
            }""",
            arg=n_code,
            timeout=240_000,
        )
        page.keyboard.press("Control+s")
        page.wait_for_timeout(1500)
        verdicts = page.locator(".course-verdict").all_inner_texts()
        scoreboards = page.locator(".course-scoreboard").all_inner_texts()
        errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").all_inner_texts()
        tracebacks = page.locator(".jp-RenderedText[data-mime-type='application/vnd.jupyter.error']").count()
        if stem == "zh-00":
            page.locator(".course-verdict").first.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "jupyterlab-lesson00-zh-learner.png"))
        page.locator(".lm-MenuBar-itemLabel", has_text="Kernel").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Shut Down Kernel").first.click()
    except Exception:
        page.screenshot(path=str(ARTIFACTS / f"jupyterlab-failure-{stem}.png"))
        raise
    finally:
        page.close()
    saved = nbformat.read(lab["dir"] / name, as_version=4)
    code = [c for c in saved.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), "not every cell ran"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"] and tracebacks == 0, "a cell raised in JupyterLab"
    assert not [e for e in errors if "Traceback" in e], errors
    return saved, verdicts, scoreboards


def start_kernel(page) -> None:
    """Accept the kernel dialog if JupyterLab shows one, then wait until the kernel is idle."""
    try:
        page.locator(".jp-Dialog").get_by_role("button", name="Select", exact=True).click(timeout=10_000)
    except playwright.Error:
        pass  # no dialog: the kernel started by itself
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(timeout=90_000)


PRINTED_URL = re.compile(r"http://127\.0\.0\.1:\d+/\S*\?token=[0-9a-f]{16,}")


@pytest.fixture
def course_lab(tmp_path):
    """`python -m course_utils lab` as `make lab` runs it, with the learner's work folder in tmp_path; yields what it printed."""
    port = free_port()  # the token is JupyterLab's own: the test reads the URL it prints, as a learner would
    command = [sys.executable, "-m", "course_utils", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1"]
    env = {k: v for k, v in os.environ.items() if k not in ("COURSE_CHECKER", "COURSE_CHECK_MODE", "PYTEST_ADDOPTS")}
    env |= {"COURSE_WORK_DIR": str(tmp_path / "work"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
            "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / ".settings"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / ".workspaces")}
    # Every cell in the page (JupyterLab 4 otherwise leaves off-screen cells out), and no autosave: unsaved stays unsaved.
    for plugin, settings in (("notebook-extension/tracker", {"windowingMode": "none"}), ("docmanager-extension/plugin", {"autosave": False})):
        folder, name = plugin.split("/")
        (tmp_path / ".settings" / "@jupyterlab" / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / ".settings" / "@jupyterlab" / folder / f"{name}.jupyterlab-settings").write_text(json.dumps(settings))
    log = tmp_path / "lab.log"
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    deadline = time.monotonic() + 60
    while not PRINTED_URL.search(log.read_text()):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail(f"JupyterLab did not start: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    tracked = [psutil.Process(server.pid)]
    try:
        yield {"log": log, "port": port, "dir": tmp_path, "env": env}
    finally:
        tracked += [c for c in tracked[0].children(recursive=True)]
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        gone, alive = psutil.wait_procs(tracked, timeout=10)
        for proc in alive:
            proc.kill()
        assert not alive, f"processes left behind by JupyterLab: {[p.pid for p in alive]}"


def test_the_printed_url_opens_lesson_00(course_lab, browser):
    """The URL `make lab` prints opens the learner's lesson 00, not the Launcher, with no news pop-up."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    screenshot = ARTIFACTS / "jupyterlab-lesson00.png"
    url = PRINTED_URL.search(course_lab["log"].read_text()).group(0)
    assert url.startswith(f"http://127.0.0.1:{course_lab['port']}/lab/tree/work/00_orientation.ipynb?token=")
    assert (course_lab["dir"] / "work" / "00_orientation.ipynb").exists()  # made before JupyterLab started
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    try:
        page.goto(url)
        page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
        page.wait_for_timeout(3000)  # the news question, when asked, comes a moment after start-up
        page.screenshot(path=str(screenshot))
        tabs = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tabLabel").all_inner_texts()
        current = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel").all_inner_texts()
        first_heading = page.locator(".jp-Notebook .jp-MarkdownOutput h1").first.inner_text()
        body = page.locator("body").inner_text()
        toasts = page.locator(".Toastify__toast").count()
    finally:
        page.close()
    assert current == ["00_orientation.ipynb"], tabs
    assert "Launcher" not in tabs
    assert "Orientation" in first_heading
    assert "Jupyter news" not in body and toasts == 0, body[-500:]  # "Would you like to get notified about official Jupyter news?"
    assert screenshot.exists() and screenshot.stat().st_size > 10_000


# ---------------------------------------------------------------- the learner's loop: a broken cell, unsaved work, a reset beside the tab

def cell(page, index: int):
    return page.locator(".jp-Notebook .jp-Cell").nth(index)


def type_into(page, index: int, text: str) -> None:
    """Replace a cell's text as a learner types it (one insertion: no auto-closed brackets, no auto-indent)."""
    cell(page, index).locator(".cm-content").click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(text)


def run_cell(page, index: int, timeout: float = 120_000) -> str:
    """Run one cell (Shift+Enter) and wait until its prompt shows a new execution count; return its outputs' text."""
    prompt = cell(page, index).locator(".jp-InputPrompt")
    before = prompt.inner_text().strip()
    cell(page, index).locator(".cm-content").click()
    page.keyboard.press("Shift+Enter")
    page.wait_for_function(
        """([i, before]) => {
            const p = document.querySelectorAll('.jp-Notebook .jp-Cell')[i].querySelector('.jp-InputPrompt').textContent.trim();
            return /^\\[\\d+\\]:$/.test(p) && p !== before;
        }""",
        arg=[index, before], timeout=timeout)
    return "\n".join(cell(page, index).locator(".jp-OutputArea-output").all_inner_texts())


def course(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "course_utils", *args], capture_output=True, text=True, timeout=300, env=env)


def test_a_broken_cell_unsaved_work_and_a_reset_beside_the_open_tab(course_lab, browser):
    """Lesson 00 in the browser: a missing bracket is named by its check; a pass not yet saved is named by `check`;
    `reset` refuses while the tab is open, and --force tells the learner to reload it."""
    work = course_lab["dir"] / "work"
    path = work / "00_orientation.ipynb"
    nb = nbformat.read(path, as_version=4)
    setup = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and SETUP_TAG not in c.metadata.get("tags", []))  # the imports
    code = next(i for i, c in enumerate(nb.cells) if any(t.startswith("exercise:") for t in c.metadata.get("tags", [])))
    name = next(t for t in nb.cells[code].metadata["tags"] if t.startswith("exercise:")).split(":", 1)[1]
    check = next(i for i, c in enumerate(nb.cells) if f"check:{name}" in c.metadata.get("tags", []))
    stub = nb.cells[code].source
    answer = next(c.source for c in nbformat.read(ROOT / "notebooks" / "solutions" / path.name, as_version=4).cells
                  if f"exercise:{name}" in c.metadata.get("tags", []))
    answer = "\n".join(line for line in answer.splitlines() if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))
    broken_line = next(n for n, line in enumerate(stub.splitlines(), 1) if line.strip() == "raise NotImplementedError()")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(PRINTED_URL.search(course_lab["log"].read_text()).group(0))
        cell(page, code).wait_for(timeout=60_000)
        start_kernel(page)
        run_cell(page, setup)
        run_cell(page, code)  # the stub, as Run All leaves it
        type_into(page, code, stub.replace("raise NotImplementedError()", "return (x + 1"))
        run_cell(page, code)
        broken = run_cell(page, check)
        cell(page, check).scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "jupyterlab-broken-cell.png"))
        type_into(page, code, answer)
        run_cell(page, code)
        passed = run_cell(page, check)
        checked = course("check", "00", env=course_lab["env"])  # reads the file, which still has the stub
        page.keyboard.press("Control+s")  # saved now, the answer is in the file that reset replaces
        deadline = time.monotonic() + 30
        while "raise NotImplementedError()" in nbformat.read(path, as_version=4).cells[code].source and time.monotonic() < deadline:
            time.sleep(0.2)
        refused = course("reset", "00", env=course_lab["env"])
        forced = course("reset", "00", "--force", env=course_lab["env"])
        page.locator(".lm-MenuBar-itemLabel", has_text="File").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Reload Notebook from Disk").first.click()
        try:
            page.locator(".jp-Dialog").get_by_role("button", name="Reload", exact=True).click(timeout=5_000)
        except playwright.Error:
            pass  # reloaded without asking
        page.wait_for_function("([i, s]) => document.querySelectorAll('.jp-Notebook .jp-Cell')[i].innerText.includes(s)",
                               arg=[code, "raise NotImplementedError()"], timeout=30_000)
        page.locator(".lm-MenuBar-itemLabel", has_text="Kernel").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Shut Down Kernel").first.click()
    except Exception:
        page.screenshot(path=str(ARTIFACTS / "jupyterlab-failure-learner-loop.png"))
        raise
    finally:
        page.close()
    assert f"FAIL {name}: your cell for `{name}` raised SyntaxError at line {broken_line} (" in broken, broken
    assert "fix it and run that cell again" in broken and ".py" not in broken
    assert passed.startswith(f"PASS {name}"), passed
    assert "lesson 00 has changes newer than the saved file: save it (Ctrl-S) and check again" in checked.stdout, checked.stdout
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith(f"error: {path} is open in JupyterLab (http://"), refused.stderr
    assert forced.returncode == 0 and forced.stdout.splitlines()[-1].startswith(f"if {path} is open in JupyterLab, use File → Reload"), forced.stdout
    assert nbformat.read(path, as_version=4).cells[code].source == stub
    (backup,) = (work / "backups").glob("00_orientation.*.ipynb")
    assert nbformat.read(backup, as_version=4).cells[code].source == answer  # the saved work is kept
