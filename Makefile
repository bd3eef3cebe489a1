# Two commands do everything: `make lab` opens the course, `make test` tests it.
# Both create .venv and install the pinned dependencies the first time only.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
NBVAL  := --nbval-current-env -p no:cacheprovider
SUPPORTED := 3.11 3.12 3.13
# Which PyTorch build the set-up installs: `pypi`, PyPI's (on Linux x86_64 a CUDA build: with its CUDA
# libraries and Triton 3.0 GB to download, 4 GB of the 6 GB .venv), or `cpu`, PyTorch's CPU-only wheels
# from its own index: the same pins (2.14.1 there is 2.14.1+cpu, which `torch==2.14.1` matches), without
# the CUDA libraries and Triton. The choice is kept in .venv/.torch: later runs, and a reinstall after a
# pin changed, keep it; another choice needs `make clean-venv` first.
TORCH ?= $(or $(shell cat $(VENV)/.torch 2>/dev/null),pypi)
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
DOWNLOAD_pypi = over 3 GB to download on Linux x86_64, 3.0 GB of it PyTorch with its CUDA libraries and Triton (6 GB installed); without an NVIDIA GPU, stop it (Ctrl-C), run make clean-venv, then make $(GOAL) TORCH=cpu
DOWNLOAD_cpu = with PyTorch's CPU-only build, 2.5 GB less to download than PyPI's Linux build (4 GB less installed)
# The course's language: `make lab COURSE_LANG=zh` (简体中文) or en, remembered in work/ for later runs. Not LANG,
# which would change the locale of every command make runs; the course never reads LANG, LANGUAGE or LC_ALL.
COURSE_LANG ?=
# Extra options for `jupyter lab`, e.g. make lab LAB_ARGS="--port=8889 --no-browser".
# (As root, `course_utils lab` adds --allow-root itself: Jupyter refuses root without it.)
LAB_ARGS ?=
TEST_JOBS ?= $(shell n=$$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2); [ "$$n" -gt 4 ] && n=4; echo $$n)
XDIST = $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile)
GOAL := $(or $(firstword $(MAKECMDGOALS)),lab)

.PHONY: lab test notebooks build lock clean-venv check-python

# Stop, saying how to recover, before using a .venv that cannot work: made by a Python the
# course does not support, left half-built (its python or pip missing), or made by another
# Python than the PYTHON=... asked for. Without a .venv, PYTHON must be 3.11, 3.12 or 3.13.
check-python:
	@if [ -f $(VENV)/.torch ] && [ "$$(cat $(VENV)/.torch)" != "$(TORCH)" ]; then \
	    echo "error: $(VENV) has PyTorch's $$(cat $(VENV)/.torch) build, not TORCH=$(TORCH): run \`make clean-venv\`, then \`make $(GOAL) TORCH=$(TORCH)\`."; exit 1; \
	fi
	@version() { "$$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }; \
	supported() { case " $(SUPPORTED) " in *" $$1 "*) return 0;; esac; return 1; }; \
	recover="Remove it with \`make clean-venv\`, then run \`make $(GOAL) PYTHON=python3.11\` (or python3.12, python3.13)."; \
	if [ -e $(VENV) ]; then \
	    have=$$(version $(PY)); \
	    if [ -z "$$have" ]; then \
	        echo "error: $(VENV) is half-built or broken: $(PY) does not run (was its Python removed or upgraded?)."; \
	    elif ! supported "$$have"; then \
	        echo "error: $(VENV) was made with Python $$have; the course needs Python 3.11, 3.12 or 3.13."; \
	    elif ! $(PY) -m pip --version >/dev/null 2>&1; then \
	        echo "error: $(VENV) is half-built: it has no pip (on Debian or Ubuntu, install python3-venv first)."; \
	    elif [ -n "$(filter command line environment,$(origin PYTHON))" ] && [ "$$(version $(PYTHON))" != "$$have" ]; then \
	        echo "error: $(VENV) was made with Python $$have, but PYTHON=$(PYTHON) is $$(version $(PYTHON) || echo 'not found')."; \
	    else \
	        exit 0; \
	    fi; \
	    echo "       $$recover"; exit 1; \
	fi; \
	want=$$(version $(PYTHON)); \
	if [ -z "$$want" ]; then \
	    echo "error: $(PYTHON) was not found. Install Python 3.11, 3.12 or 3.13, then run \`make $(GOAL) PYTHON=python3.11\` (or python3.12, python3.13)."; exit 1; \
	elif ! supported "$$want"; then \
	    echo "error: $(PYTHON) is Python $$want; the course needs 3.11, 3.12 or 3.13: run \`make $(GOAL) PYTHON=python3.11\` (or python3.12, python3.13)."; exit 1; \
	fi

# The first run shows pip's own progress, after one line that says how much it downloads; later runs,
# with .venv up to date, print nothing of this. For `make test` the same pip run installs the test extra
# too (one resolve, not two), and .venv/.extras says so; after `make lab` the test set-up adds that extra.
EXTRA := $(if $(filter test,$(GOAL)),[test])
# pip compiles each package's bytecode one file at a time; compileall does it on every core (on 2 cores the
# set-up took 127 s, not 144-176 s). Like pip, it skips the odd file written for a newer Python than this one.
COMPILE = $(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true
$(STAMP): pyproject.toml constraints.txt | check-python
	@case "$(TORCH)" in pypi|cpu) ;; *) echo "error: TORCH=$(TORCH): give TORCH=pypi (PyPI's PyTorch) or TORCH=cpu (PyTorch's CPU-only wheels)"; exit 1;; esac
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "Installing the course's pinned packages into $(VENV), $(DOWNLOAD_$(TORCH)). Later runs skip this."
	$(PY) -m pip install --quiet --upgrade "pip>=24"
	$(if $(filter cpu,$(TORCH)),$(PY) -m pip install --no-deps --no-compile --index-url $(TORCH_CPU_INDEX) -c constraints.txt torch torchvision)
	$(PY) -m pip install --no-compile -c constraints.txt -e $(if $(EXTRA),".$(EXTRA)",.)
	$(COMPILE)
	echo $(TORCH) > $(VENV)/.torch
	echo "$(EXTRA)" > $(VENV)/.extras
	touch $(STAMP)

# The Chinese edition's messages: pybabel compiles each catalog (.po) to the .mo file gettext reads, here on
# the first run and again whenever a .po changes. git ignores the .mo files: they are never edited or committed.
PO := $(wildcard course_utils/locale/*/LC_MESSAGES/course_utils.po)
MO := $(PO:.po=.mo)
$(MO): %.mo: %.po | $(STAMP)
	$(PY) -m babel.messages.frontend --quiet compile -d course_utils/locale -D course_utils

# The test extra: playwright, which drives Debian's chromium, and nbgitpuller, for the JupyterHub test.
$(TEST_STAMP): $(STAMP)
	@grep -qxF "[test]" $(VENV)/.extras 2>/dev/null || { echo "Installing the test extra (playwright, which drives Debian's chromium, and nbgitpuller, for the JupyterHub test)."; \
	    echo '$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"'; $(PY) -m pip install --quiet -c constraints.txt -e ".[test]"; }
	touch $(TEST_STAMP)

# Makes your copies in work/ (never overwriting one), then opens JupyterLab on lesson 00
# with the course folder as its root and the course's settings (.jupyter/).
lab: check-python $(STAMP) $(MO)
	$(PY) -m course_utils lab $(if $(COURSE_LANG),--lang $(COURSE_LANG)) $(LAB_ARGS)

# Unit tests (tests/test_notebooks.py also runs the learner copies: every check
# must say "not attempted" and nothing else may fail), and the solution notebooks
# under strict nbval: every check passes, deterministic outputs compared, no
# DeprecationWarning or FutureWarning printed, and no process left running once a lesson's kernel stops.
# The tests run in TEST_JOBS processes (pytest-xdist; default: one per CPU core, at most 4), a file at a time
# in each, so a notebook's cells stay in order in one kernel. TEST_JOBS=0 runs them in this process, one by one.
# The tests speak English (COURSE_LANG=en), whatever language `make lab COURSE_LANG=zh` remembered; the Chinese
# copies still run in Chinese, since the checker gives each notebook the language of its edition.
test: check-python $(TEST_STAMP) $(MO)
	COURSE_LANG=en $(PY) -m pytest tests notebooks/solutions --nbval $(NBVAL) --course-strict-warnings --course-no-leftovers --durations=30 $(XDIST)

# Re-run every solution notebook to refresh its outputs, then rebuild the learner copies; then the same for the
# Chinese edition, whose notebooks are built from the English ones and notebooks/locale/zh_CN/ (CONTRIBUTING.md).
notebooks: check-python $(STAMP) $(MO)
	$(PY) -m course_utils build --execute
	$(PY) -m course_utils build --execute --lang zh

build: check-python $(STAMP) $(MO)
	$(PY) -m course_utils build
	$(PY) -m course_utils build --lang zh

# Every installed package, setuptools included (torch needs it at run time), except pip and the course itself.
lock: check-python $(STAMP)
	{ grep '^#' constraints.txt; $(PY) -m pip freeze --all --exclude-editable | grep -v -E '^(course|pip==)' ; } > constraints.tmp && mv constraints.tmp constraints.txt

# Removes the virtual environment (not your notebooks in work/); the next `make lab` or `make test` makes a fresh one.
clean-venv:
	rm -rf $(VENV)
