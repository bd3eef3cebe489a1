#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image from the zip (with network).
# It installs a Python the course supports, bubblewrap, and the course's pinned packages into
# /autograder/venv with PyTorch's CPU-only build, then the course itself (course_utils), editable,
# from /autograder/source, and makes the course and the venv read-only to everyone but root.
#
# PyTorch's CPU-only wheels (its own index) and not PyPI's: Gradescope lends no GPU, and PyPI's Linux
# wheel brings 3 GB of CUDA libraries and Triton that every image build would download for nothing.
# The pins are the course's (constraints.txt): `torch==2.14.1` admits the index's 2.14.1+cpu.
set -euo pipefail

ROOT="${COURSE_AUTOGRADER_ROOT:-/autograder}"  # the course's tests only: a folder laid out like /autograder
SOURCE="$ROOT/source"
VENV="$ROOT/venv"
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
export DEBIAN_FRONTEND=noninteractive

supported() { "$1" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))' 2>/dev/null; }

apt-get update -qq
# bubblewrap: the sandbox each submission runs in, where the container allows it (else run_autograder
# drops to the user nobody with setpriv, from util-linux, which every Ubuntu image has).
apt-get install -y -qq --no-install-recommends bubblewrap ca-certificates >/dev/null

PYTHON=""
for candidate in python3.13 python3.12 python3.11 python3; do
    if command -v "$candidate" >/dev/null && supported "$candidate"; then PYTHON="$candidate"; break; fi
done
if [ -z "$PYTHON" ]; then
    # Ubuntu 22.04 (Gradescope's default base image) ships Python 3.10; its universe has 3.11.
    apt-get install -y -qq --no-install-recommends python3.11 python3.11-venv >/dev/null
    PYTHON=python3.11
fi
version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# Debian and Ubuntu keep venv's ensurepip in a package of its own.
"$PYTHON" -m ensurepip --version >/dev/null 2>&1 || apt-get install -y -qq --no-install-recommends "python$version-venv" >/dev/null

"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade "pip>=24"
"$VENV/bin/python" -m pip install --quiet --no-deps --index-url "$TORCH_CPU_INDEX" -c "$SOURCE/constraints.txt" torch torchvision
"$VENV/bin/python" -m pip install --quiet -c "$SOURCE/constraints.txt" -e "$SOURCE"
"$VENV/bin/python" -m compileall -q "$SOURCE/course_utils" >/dev/null  # nobody cannot write __pycache__ later

chown -R root:root "$SOURCE" "$VENV"
chmod -R a+rX,go-w "$SOURCE" "$VENV"
chmod 0755 "$ROOT"
"$VENV/bin/python" -c "import torch, course_utils; print('course_utils', course_utils.__version__, 'with torch', torch.__version__)"
