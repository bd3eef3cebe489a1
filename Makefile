# Two commands do everything: `make lab` opens the course, `make test` tests it.
# Both create .venv and install the pinned dependencies the first time only.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NBVAL  := --nbval-current-env -p no:cacheprovider

.PHONY: lab test unit notebooks learner-check build lock clean-venv

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=24"
	$(PY) -m pip install --quiet -c constraints.txt -e .
	touch $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/00_orientation.ipynb

# Unit tests, then the solution notebooks (every check must pass, deterministic
# outputs compared), then the learner copies (every check "not attempted").
test: $(STAMP)
	$(PY) -m pytest tests notebooks/solutions --nbval $(NBVAL)

unit: $(STAMP)
	$(PY) -m pytest tests -m "not notebooks"

# Re-run every solution notebook to refresh its outputs, then rebuild the learner copies.
notebooks: $(STAMP)
	$(PY) -m course_utils build --execute

build: $(STAMP)
	$(PY) -m course_utils build

lock: $(STAMP)
	{ head -2 constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -v '^course' ; } > constraints.tmp && mv constraints.tmp constraints.txt

clean-venv:
	rm -rf $(VENV)
