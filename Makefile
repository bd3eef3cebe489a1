# Two commands do everything: `make lab` opens the course, `make test` tests it.
# Both create .venv and install the pinned dependencies the first time only.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
NBVAL  := --nbval-current-env -p no:cacheprovider
# Jupyter refuses to run as root unless told to; containers often run as root.
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: lab test notebooks build lock clean-venv

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=24"
	$(PY) -m pip install --quiet -c constraints.txt -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $(TEST_STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(LAB_ARGS) notebooks/00_orientation.ipynb

# Unit tests (tests/test_notebooks.py also runs the learner copies: every check
# must say "not attempted" and nothing else may fail), then the solution notebooks
# under strict nbval: every check passes, deterministic outputs compared, no
# DeprecationWarning or FutureWarning printed.
test: $(TEST_STAMP)
	$(PY) -m pytest tests notebooks/solutions --nbval $(NBVAL) --course-strict-warnings

# Re-run every solution notebook to refresh its outputs, then rebuild the learner copies.
notebooks: $(STAMP)
	$(PY) -m course_utils build --execute

build: $(STAMP)
	$(PY) -m course_utils build

lock: $(STAMP)
	{ head -2 constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -v '^course' ; } > constraints.tmp && mv constraints.tmp constraints.txt

clean-venv:
	rm -rf $(VENV)
