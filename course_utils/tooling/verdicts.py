"""A verdict: what a check concluded, and how a learner sees it (one line of text, or of HTML).

Kept apart from the checks' core so that the command line and the pytest plugin can read
verdicts without importing torch.
"""

import html
import os
import sys
from dataclasses import dataclass

from course_utils.tooling.language import N_, _

SYMBOL = {"passed": "PASS", "not attempted": "TODO", "failed": "FAIL", "not run": "----"}
# How the checker's plugin words a check cell that is missing or did not run; the grader tells them by these, in
# English or in the language the checker ran in.
CHECK_MISSING = N_("check cell missing")
DID_NOT_RUN = N_("the check cell did not run")


@dataclass(frozen=True)
class Verdict:
    """What a check concluded: status is 'passed', 'not attempted' or 'failed'; reason says why."""

    exercise: str
    status: str
    reason: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def line(self) -> str:
        """The one line a learner reads, e.g. 'FAIL linear: expected shape (4, 3), got (3, 4)'."""
        return f"{SYMBOL[self.status]} {self.exercise}: {self.reason or _('all checks passed')}"


def checker_running() -> bool:
    """True where a failed check must raise: in kernels the checker started, and outside IPython."""
    if os.environ.get("COURSE_CHECKER") == "1":
        return True
    ipython = sys.modules.get("IPython")
    return ipython is None or ipython.get_ipython() is None


COLOURS = {"passed": "#1a7f37", "not attempted": "#6e7781", "failed": "#cf222e", "not run": "#6e7781"}


def verdict_html(verdict: Verdict) -> str:
    """A verdict as one line of HTML: a coloured label, the exercise's name, the reason."""
    colour = COLOURS[verdict.status]
    label = SYMBOL[verdict.status]
    text = html.escape(verdict.reason or _("all checks passed"))
    return (
        f'<div class="course-verdict course-{verdict.status.replace(" ", "-")}" style="font-family: monospace;">'
        f'<span style="background: {colour}; color: white; padding: 0 6px; border-radius: 3px;">{label}</span> '
        f"<b>{html.escape(verdict.exercise)}</b>: {text}</div>"
    )


