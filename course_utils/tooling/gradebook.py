"""The gradebook's schema and its views: summary tables, the class's HTML page.

`course_utils.tooling.grade` runs the submissions and builds the table (one row per submission
per exercise); everything here only reads that table.
"""

import base64
import html
import io
import time
from collections import Counter

COLUMNS = ["submission", "lesson", "exercise", "status", "reason", "seconds"]
STATUSES = ["pass", "not attempted", "failed", "missing", "unreadable"]
FAILURES = ("failed", "missing")


def submission_summary(table):
    """Per submission: its lesson, exercises passed out of the lesson's total, and a note when it could not be graded."""
    import pandas as pd

    out = []
    for name, rows in table.groupby("submission", sort=False):
        graded = rows[rows["exercise"] != ""]
        unreadable = rows[rows["status"] == "unreadable"]
        out.append({
            "submission": name,
            "lesson": rows["lesson"].iloc[0],
            "passed": int((graded["status"] == "pass").sum()),
            "total": len(graded),
            "score": f"{int((graded['status'] == 'pass').sum())}/{len(graded)}" if len(graded) else "unreadable",
            "note": unreadable["reason"].iloc[0] if len(unreadable) else "",
        })
    return pd.DataFrame(out, columns=["submission", "lesson", "passed", "total", "score", "note"]).set_index("submission")


def exercise_summary(table):
    """Per exercise: how many submissions it was judged in, each status's count, the pass rate and the most common failure."""
    import pandas as pd

    out = []
    for (lesson, exercise), rows in table[table["exercise"] != ""].groupby(["lesson", "exercise"], sort=False):
        counts = rows["status"].value_counts()
        failures = Counter(rows.loc[rows["status"].isin(FAILURES), "reason"])
        common, times = failures.most_common(1)[0] if failures else ("", 0)
        out.append({
            "lesson": lesson,
            "exercise": exercise,
            "submissions": len(rows),
            **{s: int(counts.get(s, 0)) for s in ("pass", "not attempted", "failed", "missing")},
            "pass rate": round(100 * counts.get("pass", 0) / len(rows), 1),
            "most common failure": f"{common} ({times}x)" if times > 1 else common,
        })
    columns = ["lesson", "exercise", "submissions", "pass", "not attempted", "failed", "missing", "pass rate", "most common failure"]
    return pd.DataFrame(out, columns=columns)


def format_summary(table) -> str:
    """Both summary tables as text."""
    import pandas as pd

    with pd.option_context("display.max_colwidth", 90, "display.width", 250, "display.max_rows", None):
        per_exercise = exercise_summary(table)
        return "\n".join([
            "Per submission:",
            submission_summary(table).to_string(),
            "",
            "Per exercise (pass rate in %):",
            per_exercise.to_string(index=False) if len(per_exercise) else "(no submission could be graded)",
        ])


def pass_rate_chart(per_exercise) -> str:
    """A horizontal bar chart of pass rates per exercise, as a base64 PNG."""
    from matplotlib.figure import Figure

    labels = [f"{lesson} {exercise}" for lesson, exercise in zip(per_exercise["lesson"], per_exercise["exercise"])]
    fig = Figure(figsize=(7, 0.4 * len(labels) + 1.2), layout="constrained")
    ax = fig.add_subplot()
    bars = ax.barh(labels, per_exercise["pass rate"], color="#1a7f37")
    ax.bar_label(bars, fmt="%.0f%%", padding=3)
    ax.set_xlim(0, 110)
    ax.invert_yaxis()
    ax.set_xlabel("pass rate (% of submissions)")
    ax.set_title("Pass rate per exercise")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def html_report(table, title: str) -> str:
    """A self-contained page: the summary tables, a bar chart of pass rates (an embedded PNG) and every row; nothing loaded from the network."""
    per_exercise = exercise_summary(table)
    chart = f'<img alt="pass rate per exercise" src="data:image/png;base64,{pass_rate_chart(per_exercise)}">' if len(per_exercise) else ""
    return _PAGE.format(
        title=html.escape(title),
        when=time.strftime("%Y-%m-%d %H:%M"),
        n=table["submission"].nunique(),
        chart=chart,
        per_exercise=per_exercise.to_html(index=False, border=0),
        per_submission=submission_summary(table).reset_index().to_html(index=False, border=0),
        rows=table.to_html(index=False, border=0),
    )


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 15px system-ui, sans-serif; max-width: 72em; margin: 2em auto; padding: 0 1em; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }}
img {{ max-width: 100%; }}
</style></head>
<body>
<h1>{title}</h1>
<p>{n} submissions, graded {when} by <code>python -m course_utils grade</code>.</p>
<h2>Per exercise</h2>
{chart}
{per_exercise}
<h2>Per submission</h2>
{per_submission}
<h2>Every exercise of every submission</h2>
{rows}
</body></html>
"""
