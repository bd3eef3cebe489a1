"""Shared test setup: a headless matplotlib backend and pytest's `pytester` fixture."""

import matplotlib

matplotlib.use("Agg")  # before anything imports matplotlib.pyplot

pytest_plugins = ["pytester"]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts a Jupyter kernel or a subprocess (a few seconds each)")
