"""course_utils' IPython extension (course_utils/__init__.py): what `%load_ext course_utils`, every lesson's first line, sets up.

Each test runs a kernel-like shell in a child process: the extension changes the process it is loaded in
(its exit, its matplotlib backend).
"""

import os
import subprocess
import sys
import textwrap

INLINE = "module://matplotlib_inline.backend_inline"  # what ipykernel puts in MPLBACKEND

SHELL = textwrap.dedent("""
    import atexit, gc, os
    atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count()))  # registered first, so it runs last
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "course_utils")
    print("gpu magic:", "gpu" in shell.magics_manager.magics["cell"])
    shell.run_cell("import matplotlib, matplotlib.pyplot as plt\\nfig, ax = plt.subplots()\\nax.plot([1, 2])\\n"
                   "open_in_cell = len(plt.get_fignums())\\nfig = None")
    print("figures:", os.environ.get("MPLBACKEND"), shell.user_ns["matplotlib"].get_backend(), shell.user_ns["open_in_cell"],
          len(shell.user_ns["plt"].get_fignums()))

    class Cycle:
        def __del__(self):
            print("garbage finalized")

    cycle = Cycle()
    cycle.me = cycle
    del cycle
""")


def run_shell(check_mode: bool) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "COURSE_CHECK_MODE"}
    env["MPLBACKEND"] = INLINE
    if check_mode:
        env["COURSE_CHECK_MODE"] = "1"
    done = subprocess.run([sys.executable, "-c", SHELL], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_in_a_lesson_the_gpu_magic_the_backend_and_a_quick_exit():
    """The %%gpu magic is there; matplotlib is left as ipykernel set it; at exit garbage is collected once and
    finalized, and the rest frozen, so the interpreter's shutdown does not walk torch's objects again."""
    lines = run_shell(check_mode=False)
    assert "gpu magic: True" in lines, lines
    assert f"figures: {INLINE} {INLINE} 1 0" in lines, lines  # the inline backend closes a cell's figures itself
    assert lines.count("garbage finalized") == 1, lines
    assert lines[-1].startswith("frozen at exit: ") and lines.index("garbage finalized") < len(lines) - 1, lines
    assert int(lines[-1].removeprefix("frozen at exit: ")) > 100_000, lines  # torch alone leaves several hundred thousand


def test_the_checker_makes_figures_without_drawing_them():
    """In check mode figures are made on matplotlib's agg backend (nothing is drawn) and closed when their cell ends."""
    lines = run_shell(check_mode=True)
    assert "figures: agg agg 1 0" in lines, lines
