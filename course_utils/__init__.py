"""Helpers for the hands-on PyTorch course.

What the lessons import lives in modules named for what they do (device, data,
reproducibility, benchmarking, plotting, training, distributed); each lesson's
exercise checks and reference solutions live in a module of its own (lesson00,
lesson01, ...); the checker and the course's tooling live in course_utils.tooling.
"""

import atexit
import gc
import os
import sys

__version__ = "0.1.0"

# The course runs offline. ONNX Runtime's official Linux and macOS wheels (1.29 and later) start
# a telemetry uploader when the library loads: it looks up mobile.events.data.microsoft.com
# some seconds later and keeps a device id and an event cache under ~/.cache/Microsoft. Its
# documented opt-out (docs/Privacy.md, "Disabling Telemetry") must be set before it loads, and
# `import onnxruntime` comes after this package in every lesson: `%load_ext course_utils` is
# its first line, and the checker and grader import course_utils first. `disable_telemetry_events()`
# after the import is too late: the uploader is already running.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")


def check_mode() -> bool:
    """True while the exercise checker runs: lessons may then shrink epochs and repeats."""
    return os.environ.get("COURSE_CHECK_MODE", "") == "1"


def load_ipython_extension(ipython) -> None:
    """`%load_ext course_utils` registers the %%gpu cell magic, and notes which cells raise (for the checks)."""
    from course_utils.gpu_cells import gpu
    from course_utils.tooling.cellruns import watch

    ipython.register_magic_function(gpu, magic_kind="cell", magic_name="gpu")
    watch(ipython)
    speak_the_notebooks_language()
    atexit.register(collect_once_at_exit)
    if check_mode():
        draw_no_figures(ipython)


def speak_the_notebooks_language() -> None:
    """In JupyterLab, give the checks' messages in the language of the notebook's edition (a Chinese copy: Chinese).

    Jupyter Server names the kernel's notebook in JPY_SESSION_NAME; without it (nbval, nbclient) the checker or
    the build sets COURSE_LANG itself, and in any case COURSE_LANG, if set, is left as it is.
    """
    path = os.environ.get("JPY_SESSION_NAME", "")
    if "COURSE_LANG" in os.environ or not path.endswith(".ipynb"):
        return
    from course_utils.tooling.language import notebook_language

    lang = notebook_language(path)
    if lang:
        os.environ["COURSE_LANG"] = lang


def draw_no_figures(ipython) -> None:
    """While the checker runs, figures are made but not drawn: the checker needs the cells to run, not the pictures.

    Drawing a figure into a PNG costs about 0.3 s; a lesson has up to seven. Each cell's figures are closed when it
    ends, as the inline backend closes them once shown."""
    if "matplotlib" in sys.modules:  # the backend is chosen when matplotlib loads: too late to change it quietly
        return
    os.environ["MPLBACKEND"] = "agg"

    def close_figures(*_) -> None:
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")

    ipython.events.register("post_execute", close_figures)


def collect_once_at_exit() -> None:
    """Collect garbage once, then freeze what is left, so that the interpreter's own shutdown skips its collections.

    With torch imported, those collections walk every object torch made: about a second of CPU each time JupyterLab
    shuts a kernel down or restarts it (nbval and the checker kill theirs, which skips all of this). Finalizers
    still run for everything collected here; Python never promised them for objects alive at exit."""
    gc.collect()
    gc.freeze()
