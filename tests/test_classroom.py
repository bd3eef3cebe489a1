"""course_utils.tooling.classroom: offline static HTML of the solution notebooks, plus a course map."""

import re

import pytest

from course_utils.tooling.layout import source_notebooks
from course_utils.tooling.classroom import build_html, external_references, inline_markdown, plain_text

EXTERNAL_SCRIPT_OR_STYLE = re.compile(
    r"""<script\b[^>]*\bsrc\s*=\s*["']?(?:https?:)?//|<link\b[^>]*\bhref\s*=\s*["']?(?:https?:)?//|@import\s+(?:url\()?["']?(?:https?:)?//|\bimport\b[^;\n]*["'](?:https?:)?//""",
    re.IGNORECASE,
)


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    return build_html(tmp_path_factory.mktemp("html"))


def test_one_page_per_lesson_and_an_index(pages):
    index, *lessons = pages
    assert index.name == "index.html"
    assert [p.stem for p in lessons] == [s.stem for s in source_notebooks()]
    course_map = index.read_text()
    for page in lessons:
        assert f"href='{page.name}'" in course_map


def test_pages_load_nothing_from_the_network(pages):
    """No external script, stylesheet or module import; links in the text to the docs are fine."""
    for page in pages:
        text = page.read_text()
        assert not EXTERNAL_SCRIPT_OR_STYLE.findall(text), page.name
        assert not external_references(text), page.name
        assert "cdnjs" not in text and "unpkg" not in text and "jsdelivr" not in text, page.name


def test_pages_carry_outputs_and_figures(pages):
    tensors = next(p for p in pages if p.stem.startswith("01_"))
    text = tensors.read_text()
    assert "PASS checkerboard: all checks passed" in text
    assert "data:image/png;base64," in text
    assert "course map" in text.lower() and "next lesson" in text


def test_external_reference_detector_can_fail():
    assert external_references('<script src="https://cdn.example/x.js"></script>')
    assert external_references("<link rel='stylesheet' href='//cdn.example/x.css'>")
    assert not external_references('<a href="https://pytorch.org/docs">docs</a>')


def test_index_renders_backticks_as_code(pages):
    """Titles and topics such as ``Modules: `nn.Module` `` show code, not raw backticks."""
    index = pages[0].read_text()
    body = index.split("<tbody>", 1)[1]
    assert "`" not in body
    assert "<code>nn.Module</code>" in body and "<code>torch.accelerator</code>" in body
    assert "study time" in index and "<code>work/</code>" in index


def test_page_titles_have_no_backticks(pages):
    modules = next(p for p in pages if p.stem.startswith("03_"))
    title = modules.read_text().split("<title>", 1)[1].split("</title>", 1)[0]
    assert "`" not in title and "nn.Module" in title


def test_inline_markdown_escapes_and_codes():
    assert inline_markdown("Modules: `nn.Module`") == "Modules: <code>nn.Module</code>"
    assert inline_markdown("a < b, `x<y>`") == "a &lt; b, <code>x&lt;y&gt;</code>"
    assert inline_markdown("an odd ` tick") == "an odd ` tick"
    assert plain_text("Data: `Dataset` and `DataLoader`") == "Data: Dataset and DataLoader"
