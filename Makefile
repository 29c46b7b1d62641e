# The two commands: `make demo` and `make test` (`make test-fast`: the unit and quick engine tests).
# All create .venv and install first. pip's byte-compiling runs on one core (80 of its 120 s on the 2-core
# machine); compileall does the same on every core after it, and, as pip does, skips the few files of the
# installed packages that are not Python 3 (templates, examples), so its exit status is not an error.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0
export PYTHONUNBUFFERED := 1

.PHONY: install demo test test-fast lint proto clean promtool postgres

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile -r requirements.txt -r requirements-dev.txt
	$(PIP) install -q --no-deps -e .
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/trainctl demo

# Deploy tests run Debian's Prometheus (promtool + a real server); CI is root on a fresh machine.
promtool:
	command -v promtool >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; }

# The store tests run each backend: SQLite, and a real PostgreSQL server the tests start (tests/postgres_server.py).
postgres:
	ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || command -v postgres >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; }

# One pytest process per test directory (tests/run_groups.py says why), then the combined count.
test: install promtool postgres
	$(VENV)/bin/ruff check .
	$(PY) tests/run_groups.py --durations=10

# Everything not marked slow (tests/conftest.py marks the tests on Ray clusters, services and long engine
# runs), in two pytest processes at once (tests/run_groups.py --fast). pytest exits 5 when it collects
# nothing, so an empty group fails.
test-fast: install promtool postgres
	$(VENV)/bin/ruff check .
	$(PY) tests/run_groups.py --fast --durations=10

lint: install
	$(VENV)/bin/ruff check .

proto: install
	$(PY) -m trainctl.proto_gen

clean:
	rm -rf $(VENV) .trainctl
