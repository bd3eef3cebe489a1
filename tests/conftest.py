"""Shared test setup: a headless matplotlib backend and pytest's `pytester` fixture."""

import matplotlib

matplotlib.use("Agg")  # before anything imports matplotlib.pyplot

pytest_plugins = ["pytester"]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts a Jupyter kernel or a subprocess (a few seconds each)")


# The files that take longest, slowest first (seconds of one file on 2 cores with `--durations=0`, 2026-11-27):
# `make test` hands out whole files in collection order (--dist loadfile --no-loadscope-reorder), so these start
# first and no long file is left to run alone at the end while the other cores idle. A stale list costs only time.
SLOWEST_FIRST = [
    "tests/test_notebooks.py",                  # 280: every learner copy under the checker, Run All of three
    "tests/test_lesson11.py",                   # 250
    "tests/test_autograder.py",                 # 125, two runs at a time
    "tests/test_tamper.py",                     # 125
    "notebooks/solutions/11_capstone.ipynb",    # 110
    "tests/test_lesson10.py",                   # 110
    "tests/test_plugin.py",                     # 110
    "tests/test_grade_hostile.py",              # 100
    "tests/test_browser.py",                    # 100
    "tests/test_lesson09.py",                   # 100
    "tests/test_distributed.py",                # 80
    "notebooks/solutions/10_export.ipynb",      # 75
    "tests/test_grade.py",                      # 70
    "notebooks/solutions/07_compile.ipynb",     # 65
    "tests/test_lesson07.py",                   # 55
    "notebooks/solutions/09_ddp.ipynb",         # 50
    "tests/test_sandbox.py",                    # 45
    "notebooks/solutions/06_amp.ipynb",         # 40
]


def pytest_collection_modifyitems(config, items):
    """Put the files of SLOWEST_FIRST first, in its order; the rest follow in pytest's order (a stable sort)."""
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
