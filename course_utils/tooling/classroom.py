"""Static HTML of the solution notebooks, with outputs, for projecting in class or reading without Jupyter.

Built offline: the template drops the CDN scripts (require.js, MathJax, mermaid)
that nbconvert's lab template would load, so the pages work with no network.
"""

import html
import re
from pathlib import Path

import nbformat
from nbconvert import HTMLExporter

from course_utils.tooling.layout import root, source_notebooks
from course_utils.tooling.timings import lesson_facts

TEMPLATES = Path(__file__).resolve().parent / "templates"
EXTERNAL = re.compile(r"""<(?:script|link)\b[^>]*\b(?:src|href)\s*=\s*["']?(?:https?:)?//""", re.IGNORECASE)


def lesson_title(nb) -> str:
    """The first Markdown heading of a notebook."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            match = re.search(r"^#\s+(.+)$", cell.source, re.MULTILINE)
            if match:
                return match.group(1).strip()
    return "untitled"


def inline_markdown(text: str) -> str:
    """Text with Markdown's `code` spans as <code> elements, everything else HTML-escaped."""
    parts = re.split(r"`([^`]+)`", text)
    return "".join(f"<code>{html.escape(p)}</code>" if i % 2 else html.escape(p) for i, p in enumerate(parts))


def plain_text(text: str) -> str:
    """Text with Markdown's code backticks dropped (for a page's <title>)."""
    return re.sub(r"`([^`]+)`", r"\1", text)


def external_references(page: str) -> list[str]:
    """Script and stylesheet tags that would load something over the network."""
    return [m.group(0) for m in EXTERNAL.finditer(page)]


def build_html(out_dir: str | Path | None = None) -> list[Path]:
    """Write one page per solution notebook and an index.html course map; return the paths."""
    out = Path(out_dir) if out_dir is not None else root() / "build" / "html"
    out.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter(template_name="classroom", extra_template_basedirs=[str(TEMPLATES)])
    sources = source_notebooks()
    pages, rows = [], []
    for i, source in enumerate(sources):
        nb = nbformat.read(source, as_version=4)
        resources = {
            "metadata": {"name": plain_text(lesson_title(nb))},
            "course_prev": f"{sources[i - 1].stem}.html" if i > 0 else None,
            "course_next": f"{sources[i + 1].stem}.html" if i + 1 < len(sources) else None,
        }
        body, _ = exporter.from_notebook_node(nb, resources=resources)
        leaks = external_references(body)
        if leaks:
            raise RuntimeError(f"{source.name}: the page would load {leaks[0]!r} from the network")
        page = out / f"{source.stem}.html"
        page.write_text(body, encoding="utf-8")
        pages.append(page)
        facts = lesson_facts(source)
        rows.append(
            f"<tr><td><a href='{page.name}'>{inline_markdown(lesson_title(nb))}</a></td><td>{inline_markdown(facts['topics'])}</td>"
            f"<td>{facts['exercises']}</td><td>{facts['study']}</td><td>{facts['gpu']}</td></tr>"
        )
    index = out / "index.html"
    index.write_text(_INDEX.format(rows="\n".join(rows)), encoding="utf-8")
    return [index, *pages]


_INDEX = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Hands-on PyTorch: course map</title>
<style>
body {{ font: 16px system-ui, sans-serif; max-width: 64em; margin: 2em auto; padding: 0 1em; }}
table {{ border-collapse: collapse; width: 100%; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 6px 8px; text-align: left; vertical-align: top; }}
code {{ font-size: 90%; background: #f3f3f3; padding: 0 3px; border-radius: 3px; }}
</style></head>
<body>
<h1>Hands-on PyTorch: course map</h1>
<p>The solution copy of every lesson, with its outputs. Learners work in their own copies in <code>work/</code>.</p>
<table><thead><tr><th>lesson</th><th>topics</th><th>exercises</th><th>study time</th><th>GPU cells</th></tr></thead>
<tbody>
{rows}
</tbody></table>
</body></html>
"""
