# Tributary: `make run` starts a homeserver, `make test` runs the tests.
# Both create the virtualenv and install on first use, and are quick after that.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
# `make run PORT=8018`: a second instance, client API on 8018 and metrics on 9018, with its
# own data directory (data-8018) so that it has its own embedded database.
PORT ?=
DATA_DIR ?= $(if $(PORT),data-$(PORT),data)
PYTEST_ARGS ?=

.PHONY: run test services lint typecheck bench clean interop

$(VENV)/bin/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11 or newer is needed; set PYTHON=python3.11")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip

# The homeserver alone (make run), or with the test tools (make test).
$(RUN_STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet --disable-pip-version-check -e .
	@touch $(RUN_STAMP)

$(TEST_STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,spark]'
	@touch $(TEST_STAMP) $(RUN_STAMP)

run: $(RUN_STAMP)
	$(VENV)/bin/tributary run --data-dir $(DATA_DIR) $(if $(PORT),--port $(PORT))

# PostgreSQL and Redis running; Prometheus, nginx and docker-compose installed (from
# Debian's packages) for the observability and deployment tests; Java and the
# PostgreSQL JDBC driver for the Spark reports; Chromium and chromedriver for the
# operator console test; ngIRCd and heisenbridge (its own virtualenv) for the bridge test;
# matrix-js-sdk (npm, tests/js_client) for the sliding sync client test.
# Installing needs root (or sudo): see README.md.
services:
	@bash .ci/ensure-services.sh
	@bash .ci/install-observability.sh
	@bash .ci/install-spark.sh
	@bash .ci/install-browser.sh
	@bash .ci/install-js-client.sh
	@bash .ci/install-bridge.sh

test: $(TEST_STAMP) services
	$(PY) -m pytest $(PYTEST_ARGS)

typecheck: $(TEST_STAMP)
	$(PY) -m mypy

# Tributary and the current matrix-synapse release (from PyPI, in its own virtualenv)
# federating on loopback: join by alias, invite, chat and backfill both ways (not part of
# `make test`; see docs/federation.md, "Testing against another homeserver").
# SYNAPSE_VERSION=1.2.3 pins a release; the default upgrades to the newest on every run.
# It needs the test extra (matrix-nio with its e2e extra, for the encrypted DM).
SYNAPSE_VENV := .venv-synapse
SYNAPSE_VERSION ?=

interop: $(TEST_STAMP)
	@bash .ci/ensure-services.sh || echo "interop: no PostgreSQL; Tributary will use its embedded database"
	@test -x $(SYNAPSE_VENV)/bin/python || $(PYTHON) -m venv $(SYNAPSE_VENV)
	$(SYNAPSE_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --upgrade \
		'matrix-synapse[postgres]$(if $(SYNAPSE_VERSION),==$(SYNAPSE_VERSION))'
	$(PY) -m tests.interop.run_interop --synapse-python $(SYNAPSE_VENV)/bin/python

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .hypothesis
