# Tributary: `make run` starts a homeserver, `make test` runs the tests.
# Both create the virtualenv and install on first use, and are quick after that.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DATA_DIR ?= data
PYTEST_ARGS ?=

.PHONY: run test services lint typecheck bench clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11 or newer is needed; set PYTHON=python3.11")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tributary run --data-dir $(DATA_DIR)

services:
	@bash .ci/ensure-services.sh

test: $(STAMP) services
	$(PY) -m pytest $(PYTEST_ARGS)

typecheck: $(STAMP)
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .hypothesis
