# Tributary: `make run` starts a homeserver, `make test` runs the tests.
# Both create the virtualenv and install on first use, and are quick after that.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
DATA_DIR ?= data
PYTEST_ARGS ?=

.PHONY: run test services lint typecheck bench clean

$(VENV)/bin/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11 or newer is needed; set PYTHON=python3.11")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip

# The homeserver alone (make run), or with the test tools (make test).
$(RUN_STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet --disable-pip-version-check -e .
	@touch $(RUN_STAMP)

$(TEST_STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $(TEST_STAMP) $(RUN_STAMP)

run: $(RUN_STAMP)
	$(VENV)/bin/tributary run --data-dir $(DATA_DIR)

# PostgreSQL and Redis running; Prometheus, nginx and docker-compose installed (from
# Debian's packages) for the observability and deployment tests.
services:
	@bash .ci/ensure-services.sh
	@bash .ci/install-observability.sh

test: $(TEST_STAMP) services
	$(PY) -m pytest $(PYTEST_ARGS)

typecheck: $(TEST_STAMP)
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .hypothesis
