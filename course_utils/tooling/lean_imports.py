"""Loaded first by every pytest the course starts (`-p course_utils.tooling.lean_imports`): a faster start-up.

nbval reads notebooks with nbformat, which validates them with jsonschema. jsonschema imports the
optional package rfc3987_syntax when it is installed (jupyter-events, a JupyterLab dependency,
installs it) to check the "iri" string format, and that package compiles an Earley grammar with
lark as it is imported: about 3 s of CPU, over half of what a checker's pytest spends before its
kernel starts. No notebook schema uses that format. A None entry in sys.modules makes the import
raise ImportError, as if the package were not installed, and jsonschema then leaves the format
unchecked. Only the process that loads this module is affected; JupyterLab is not.
"""

import sys

sys.modules.setdefault("rfc3987_syntax", None)
