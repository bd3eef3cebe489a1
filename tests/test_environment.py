"""The three places that name dependencies agree: pyproject.toml, constraints.txt and environment.yml."""

import re
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict[str, Requirement]:
    """Dependencies and optional (extra) dependencies, by name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + [d for extra in project.get("optional-dependencies", {}).values() for d in extra]
    return {Requirement(d).name.lower(): Requirement(d) for d in deps}


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins


def _environment() -> tuple[str, dict[str, str], list[str]]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    pins = dict(line.split("#")[0].strip().split("==") for line in pip if "==" in line)
    return next(d for d in conda if d.startswith("python")), {k.lower(): v for k, v in pins.items()}, pip


def test_constraints_pin_every_direct_dependency_within_pyproject_ranges():
    pins = _constraints()
    for name, requirement in _pyproject().items():
        assert name in pins, f"{name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]} breaks pyproject's {requirement}"


def test_environment_yml_pins_the_same_versions():
    python, pins, pip_lines = _environment()
    assert set(pins) == set(_pyproject()), "environment.yml and pyproject.toml list different packages"
    constraints = _constraints()
    for name, version in pins.items():
        assert version == constraints[name], f"environment.yml has {name}=={version}, constraints.txt {constraints[name]}"
    assert "-e ." in pip_lines and "-c constraints.txt" in pip_lines


def test_python_version_agrees():
    python, _, _ = _environment()
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    version = re.search(r"python=(\d+\.\d+)", python).group(1)
    assert f">={version}" in requires.replace(" ", "")


def test_torch_and_torchvision_are_pinned_exactly():
    deps = _pyproject()
    assert str(deps["torch"].specifier) == "==2.14.1"
    assert str(deps["torchvision"].specifier) == "==0.29.1"
