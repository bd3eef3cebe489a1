"""The course on Colab and Kaggle: its repository URL, each lesson's set-up cell, and the "Open in" badges.

The URL is set once, as `Repository` in pyproject.toml's [project.urls]; a fork sets its own there
and runs `python -m course_utils build --execute`. From it the build writes:

- into every lesson, as its first code cell (tagged `hosted-setup`), the cell that in Colab or
  Kaggle clones the course from that URL and sets it up (course_utils.hosted.set_up), and that
  elsewhere does nothing: one `if` on sys.modules and os.environ, and it prints nothing;
- after every lesson's first cell, a markdown cell (tagged `hosted-badges`) with "Open in Colab"
  and "Open in Kaggle" badges for that notebook, and the same badges in the README's course map.
  Badges are made only for a GitHub URL (both services open notebooks from GitHub); with no URL,
  or another host, there are none, and the build removes any left from before.

`SETUP_TAG`'s cell is the one source of its text: the build refreshes it in every source notebook,
and the learner copies are made from those.
"""

import json
import re
import tomllib
from pathlib import Path

from course_utils.tooling.layout import lesson_of_path, root

REPOSITORY_KEY = "Repository"
BRANCH = "main"
SETUP_TAG = "hosted-setup"
BADGES_TAG = "hosted-badges"
PLUMBING_TAGS = (SETUP_TAG, BADGES_TAG)  # not the lesson's content: study time leaves them out
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
KAGGLE_BADGE = "https://kaggle.com/static/images/open-in-kaggle.svg"
GITHUB = re.compile(r"^https://github\.com/([\w.-]+)/([\w.-]+?)(?:\.git)?/?$")


def repository_url(pyproject: Path | None = None) -> str | None:
    """The course's published repository ([project.urls] Repository in pyproject.toml), or None where none is set."""
    path = pyproject or root() / "pyproject.toml"
    urls = tomllib.loads(path.read_text(encoding="utf-8")).get("project", {}).get("urls", {})
    url = urls.get(REPOSITORY_KEY, "").strip()
    return url or None


def clone_folder(url: str) -> str:
    """The folder the set-up cell clones into: the repository's name ('pytorch-course' for .../pytorch-course.git)."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"\.git$", "", name) or "course"


def setup_cell(lesson: str, url: str | None) -> str:
    """The text of a lesson's set-up cell: in Colab or Kaggle it fetches and sets up the course; elsewhere it does nothing."""
    head = ("# Colab and Kaggle only: fetch the course and set it up (elsewhere this cell does nothing).\n"
            "import os, sys\n"
            'if "google.colab" in sys.modules or "KAGGLE_KERNEL_RUN_TYPE" in os.environ:\n')
    if url is None:
        return head + ('    raise RuntimeError("this copy of the course names no repository to fetch it from: set Repository in '
                       "pyproject.toml's [project.urls], then run `python -m course_utils build --execute` (README: In Colab or Kaggle)\")")
    url_text, folder, lesson_text = (json.dumps(x) for x in (url, clone_folder(url), lesson))
    return head + (
        "    import subprocess\n"
        f"    if not os.path.isdir({folder}):\n"
        f'        subprocess.run(["git", "clone", "--depth=1", "--quiet", {url_text}, {folder}], check=True)\n'
        f"    sys.path.insert(0, os.path.abspath({folder}))\n"
        "    from course_utils.hosted import set_up\n"
        f"    set_up({lesson_text}, {folder})"
    )


def github_parts(url: str | None) -> tuple[str, str] | None:
    """(owner, repository) of a GitHub URL, else None."""
    match = GITHUB.match(url or "")
    return (match.group(1), match.group(2)) if match else None


def badges(url: str | None, notebook: str) -> str:
    """Markdown badges that open `notebook` (a path in the repository) in Colab and Kaggle; '' without a GitHub URL."""
    parts = github_parts(url)
    if parts is None:
        return ""
    owner, repo = parts
    colab = f"https://colab.research.google.com/github/{owner}/{repo}/blob/{BRANCH}/{notebook}"
    kaggle = f"https://kaggle.com/kernels/welcome?src=https://github.com/{owner}/{repo}/blob/{BRANCH}/{notebook}"
    return f"[![Open in Colab]({COLAB_BADGE})]({colab}) [![Open in Kaggle]({KAGGLE_BADGE})]({kaggle})"


def _take(nb, tag: str):
    """Remove every cell carrying tag from the notebook; the first of them, or None."""
    found = [cell for cell in nb.cells if tag in cell.metadata.get("tags", [])]
    nb.cells = [cell for cell in nb.cells if tag not in cell.metadata.get("tags", [])]
    return found[0] if found else None


def refresh(nb, path: Path, url: str | None = None, *, use_pyproject: bool = True) -> bool:
    """Put the current set-up cell and badges into a source notebook (an nbformat node) in place; True when it changed.

    path is the notebook's place in the course (notebooks/solutions/NN_topic.ipynb), for its lesson
    and its badges' links; url defaults to pyproject.toml's (use_pyproject=False: none).
    A cell already there keeps its id, and its outputs while its text is current.
    """
    import nbformat

    if url is None and use_pyproject:
        url = repository_url()
    before = nbformat.writes(nb)
    lesson = lesson_of_path(path) or nb.metadata.get("course", {}).get("lesson")
    setup, badge_cell = _take(nb, SETUP_TAG), _take(nb, BADGES_TAG)
    text = setup_cell(lesson, url)
    if setup is None:
        setup = nbformat.v4.new_code_cell(text, metadata={"tags": [SETUP_TAG]})
    elif setup.source != text:
        setup.source, setup.outputs, setup.execution_count = text, [], None
    first_code = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"), len(nb.cells))
    nb.cells.insert(first_code, setup)
    markdown = badges(url, f"notebooks/solutions/{path.name}")
    if markdown:
        if badge_cell is None:
            badge_cell = nbformat.v4.new_markdown_cell(markdown, metadata={"tags": [BADGES_TAG]})
        badge_cell.source = markdown
        first_markdown = next((i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"), -1)
        nb.cells.insert(first_markdown + 1, badge_cell)
    return nbformat.writes(nb) != before


def learner_badges(source: str) -> str:
    """A badge cell's text for the learner copy: its links open notebooks/NN_topic.ipynb, not the solution copy."""
    return source.replace("/notebooks/solutions/", "/notebooks/")


def map_badges(learner_copy: Path) -> str:
    """The badges of a lesson's learner copy for the README's course map (' ' and the badges), or '' with no GitHub URL set."""
    markdown = badges(repository_url(), f"notebooks/{learner_copy.name}")
    return f" {markdown}" if markdown else ""
