"""course_utils.tooling.publish: the repository URL, each lesson's Colab/Kaggle set-up cell and its badges, and the build that writes them."""

import json
import shutil
import sys
import timeit
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from course_utils.tooling import publish, studytime, tamper
from course_utils.tooling.build import build, learner_copy, tag_source
from course_utils.tooling.layout import learner_path, source_for, source_notebooks

GITHUB_URL = "https://github.com/someone/pytorch-course"


def lesson_notebook():
    """A small lesson: its objectives, its imports, an exercise, its check, the scoreboard."""
    return new_notebook(cells=[
        new_markdown_cell("# Lesson 01\n\nObjectives."),
        new_code_cell("%load_ext course_utils\nimport torch"),
        new_code_cell("def add_one(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION"),
        new_code_cell("lesson01.check_add_one(add_one)"),
        new_code_cell("lesson01.scoreboard()"),
    ], metadata={"course": {"lesson": "01"}})


def tagged(nb, tag):
    return [i for i, c in enumerate(nb.cells) if tag in c.metadata.get("tags", [])]


def test_the_set_up_cell_outside_a_hosted_runtime_does_nothing_and_costs_nothing(monkeypatch, capsys):
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    assert "google.colab" not in sys.modules
    for url in (GITHUB_URL, None):
        code = compile(publish.setup_cell("05", url), "<set-up cell>", "exec")
        namespace = {}
        exec(code, namespace)
        assert set(namespace) == {"__builtins__", "os", "sys"}  # no subprocess, no course_utils
        assert capsys.readouterr() == ("", "")  # nbval compares nothing new in the solution copies
        seconds = timeit.timeit(lambda: exec(code, {}), number=1000) / 1000
        assert seconds < 0.001, f"the set-up cell took {seconds * 1e6:.0f} µs outside a hosted runtime"


def test_without_a_url_the_cell_says_in_a_hosted_runtime_how_to_set_one(monkeypatch):
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    with pytest.raises(RuntimeError, match=r"set Repository in pyproject.toml's \[project.urls\]"):
        exec(publish.setup_cell("05", None), {})


def test_the_set_up_cell_clones_the_url_into_a_folder_named_after_it():
    cell = publish.setup_cell("05", GITHUB_URL + ".git")
    assert '"git", "clone", "--depth=1", "--quiet", "https://github.com/someone/pytorch-course.git", "pytorch-course"' in cell
    assert 'set_up("05", "pytorch-course")' in cell
    assert publish.clone_folder("file:///tmp/x/published/") == "published"


def test_repository_url_comes_from_pyproject(tmp_path):
    path = tmp_path / "pyproject.toml"
    path.write_text('[project]\nname = "x"\n')
    assert publish.repository_url(path) is None
    path.write_text(f'[project]\nname = "x"\n\n[project.urls]\nRepository = "{GITHUB_URL}"\n')
    assert publish.repository_url(path) == GITHUB_URL
    assert publish.repository_url() is None  # the course has no published repository yet: no badges anywhere


def test_refresh_inserts_the_set_up_cell_once_and_badges_only_with_a_github_url():
    nb, path = lesson_notebook(), Path("notebooks/solutions/01_tensors.ipynb")
    assert publish.refresh(nb, path, use_pyproject=False)
    assert tagged(nb, publish.SETUP_TAG) == [1] and tagged(nb, publish.BADGES_TAG) == []  # first code cell; no URL, no badge
    assert "raise RuntimeError" in nb.cells[1].source
    assert not publish.refresh(nb, path, use_pyproject=False)  # idempotent
    cell_id = nb.cells[1].id
    assert publish.refresh(nb, path, GITHUB_URL)
    assert tagged(nb, publish.SETUP_TAG) == [2] and tagged(nb, publish.BADGES_TAG) == [1]
    assert nb.cells[2].id == cell_id and "git" in nb.cells[2].source  # the same cell, its text refreshed
    assert "colab.research.google.com/github/someone/pytorch-course/blob/main/notebooks/solutions/01_tensors.ipynb" in nb.cells[1].source
    assert "kaggle.com/kernels/welcome?src=https://github.com/someone/pytorch-course/blob/main/notebooks/solutions/01_tensors.ipynb" in nb.cells[1].source
    before = nbformat.writes(nb)
    assert not publish.refresh(nb, path, GITHUB_URL) and nbformat.writes(nb) == before
    assert publish.refresh(nb, path, "https://gitlab.com/someone/pytorch-course")  # Colab opens GitHub only: no badge
    assert tagged(nb, publish.BADGES_TAG) == [] and "gitlab.com" in nb.cells[1].source
    assert publish.refresh(nb, path, use_pyproject=False) and not tagged(nb, publish.BADGES_TAG)


def test_the_learner_copy_keeps_the_set_up_cell_and_its_badges_open_the_learner_copy():
    nb = lesson_notebook()
    tag_source(nb)
    publish.refresh(nb, Path("notebooks/solutions/01_tensors.ipynb"), GITHUB_URL)
    learner = learner_copy(nb)
    assert learner.cells[2].source == nb.cells[2].source and learner.cells[2].metadata["tags"] == [publish.SETUP_TAG]
    assert "/blob/main/notebooks/01_tensors.ipynb" in learner.cells[1].source and "solutions" not in learner.cells[1].source
    assert tamper.scan(json.loads(nbformat.writes(learner))) == []  # the set-up cell is nothing to review


def test_build_writes_them_into_copies_of_real_lessons(tmp_path, monkeypatch):
    """`build` on copies of lessons 00 and 01 in a temporary course folder, with and without a repository URL."""
    solutions = tmp_path / "notebooks" / "solutions"
    solutions.mkdir(parents=True)
    sources = [Path(shutil.copy(source_for(n), solutions)) for n in ("00", "01")]
    originals = {s.name: nbformat.read(s, as_version=4) for s in sources}
    for url in (None, GITHUB_URL):
        monkeypatch.setattr(publish, "repository_url", lambda url=url: url)
        build(sources)
        for source in sources:
            nb, learner = nbformat.read(source, as_version=4), nbformat.read(learner_path(source), as_version=4)
            first_code = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
            assert tagged(nb, publish.SETUP_TAG) == [first_code] and tagged(learner, publish.SETUP_TAG) == [first_code]
            assert len(tagged(learner, publish.BADGES_TAG)) == (url is not None)
            assert nbformat.writes(learner) == nbformat.writes(learner_copy(nb))  # what test_notebooks holds
            assert studytime.estimate(nb) == studytime.estimate(originals[source.name])  # plumbing is no study time
            assert tamper.scan(json.loads(nbformat.writes(learner))) == []
        again = {s: s.read_bytes() for s in [*sources, *map(learner_path, sources)]}
        build(sources)
        assert {s: s.read_bytes() for s in again} == again  # a second build changes nothing


def test_the_course_map_shows_badges_exactly_when_the_url_is_set(monkeypatch):
    from course_utils.tooling import timings

    facts = {"name": "00 orientation", "topics": "t", "exercises": 2, "study": "45 min / 45 min", "gpu": 1}
    source = source_for("00")
    row = timings._row(source, facts, "3.3 s", "3.4 s")
    assert "colab" not in row and "kaggle" not in row
    monkeypatch.setattr(publish, "repository_url", lambda: GITHUB_URL)
    row = timings._row(source, facts, "3.3 s", "3.4 s")
    assert "colab.research.google.com/github/someone/pytorch-course/blob/main/notebooks/00_orientation.ipynb" in row


def test_every_lesson_carries_the_current_set_up_cell():
    """Every lesson carries the current Colab set-up cell (and badges, when a GitHub URL is set), as the build writes them."""
    carrying = {s.name: tagged(nbformat.read(s, as_version=4), publish.SETUP_TAG) for s in source_notebooks()}
    assert all(carrying.values()), f"no Colab set-up cell in {[n for n, c in carrying.items() if not c]}: run `make notebooks`"
    url = publish.repository_url()
    for source in source_notebooks():  # the learner copies follow their sources (tests/test_notebooks.py)
        nb = nbformat.read(source, as_version=4)
        assert not publish.refresh(nb, source, url, use_pyproject=False), f"{source.name}: its set-up cell or badges are stale: run `make build`"
