"""`python -m course_utils ...`: the course's command line (course_utils.tooling.cli)."""

import sys

from course_utils.tooling.cli import main

if __name__ == "__main__":
    sys.exit(main())
