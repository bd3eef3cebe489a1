"""Helpers for the hands-on PyTorch course.

What the lessons import lives in modules named for what they do (device, data,
reproducibility, benchmarking, plotting, training, distributed); each lesson's
exercise checks and reference solutions live in a module of its own (lesson00,
lesson01, ...); the checker and the course's tooling live in course_utils.tooling.
"""

import os

__version__ = "0.1.0"


def check_mode() -> bool:
    """True while the exercise checker runs: lessons may then shrink epochs and repeats."""
    return os.environ.get("COURSE_CHECK_MODE", "") == "1"


def load_ipython_extension(ipython) -> None:
    """`%load_ext course_utils` registers the %%gpu cell magic."""
    from course_utils.gpu_cells import gpu

    ipython.register_magic_function(gpu, magic_kind="cell", magic_name="gpu")
