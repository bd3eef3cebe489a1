"""course_utils' IPython extension (course_utils/__init__.py): what `%load_ext course_utils`, every lesson's first line, sets up."""

import subprocess
import sys
import textwrap

# Run in a child: the extension's exit handler freezes the collector of the process it is loaded in.
KERNEL_EXIT = textwrap.dedent("""
    import atexit, gc
    atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count()))  # registered first, so it runs last
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "course_utils")
    shell.run_cell("import torch")

    class Cycle:
        def __del__(self):
            print("garbage finalized")

    cycle = Cycle()
    cycle.me = cycle
    del cycle
""")


def test_a_kernel_collects_once_then_freezes_before_the_interpreter_shuts_down():
    """Garbage left at exit is still finalized; the rest is frozen, so shutdown does not walk torch's objects again."""
    done = subprocess.run([sys.executable, "-c", KERNEL_EXIT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines.count("garbage finalized") == 1, done.stdout
    frozen = int(lines[-1].removeprefix("frozen at exit: "))
    assert frozen > 100_000, done.stdout  # torch alone leaves several hundred thousand objects
    assert lines.index("garbage finalized") < len(lines) - 1


def test_the_extension_registers_the_gpu_magic():
    done = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        shell.run_line_magic("load_ext", "course_utils")
        print("gpu" in shell.magics_manager.magics["cell"])
    """)], capture_output=True, text=True, timeout=120)
    assert done.stdout.split()[-1] == "True", done.stdout + done.stderr
