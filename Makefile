# The two commands a new user types are `make run` and `make test`; everything else is for developers.
# Nothing but Python 3.11+ and make is assumed: uv is installed into a bootstrap venv when the machine
# has none, and it installs the locked dependencies into .venv.

PYTHON ?= python3
UV := $(or $(shell command -v uv 2>/dev/null),$(CURDIR)/.boot/bin/uv)
VENV := $(CURDIR)/.venv
BIN := $(VENV)/bin
# uv must use this machine's Python, never download one.
export UV_PYTHON_DOWNLOADS := never
export UV_PROJECT_ENVIRONMENT := $(VENV)

.PHONY: run test lint docs docs-serve dist-check format bench faults soak sync clean help

help:  ## list the targets
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

# The example source's signing secret. A demo value, public on purpose: the storm that `make run`
# fires signs with it. Set your own (and never commit it) for anything real.
PGONCE_DEMO_SECRET ?= whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw
export PGONCE_DEMO_SECRET

run: $(VENV)/.synced  ## start the service on the example config (embedded PostgreSQL without PGONCE_DSN) and prove exactly-once
	$(BIN)/pgonce serve --config examples/pgonce.toml --demo

test: $(VENV)/.synced  ## the whole test suite (PGONCE_TEST_DSN selects a server, else embedded)
	$(BIN)/pytest -n auto $(PYTEST_ARGS)

lint: $(VENV)/.synced  ## ruff, ruff format --check, mypy --strict, sync-code drift check, the docs site
	$(BIN)/ruff check src tests bench tools faults
	$(BIN)/ruff format --check src tests bench tools faults
	$(BIN)/python tools/gen_sync.py --check
	$(BIN)/mypy
	$(MAKE) docs

docs: $(VENV)/.synced  ## build the documentation site into site/; any warning is an error
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

docs-serve: $(VENV)/.synced  ## the documentation site on http://127.0.0.1:8001, rebuilt on change
	$(BIN)/mkdocs serve --dev-addr 127.0.0.1:8001

# The distribution as a user gets it: build the sdist and wheel, install the wheel alone into a new
# venv outside the checkout, run the docs' quickstart and `pgonce migrate` on a real PostgreSQL
# ($$PGONCE_TEST_DSN), then add [server,embedded] and see `pgonce serve` answer /readyz.
dist-check: $(VENV)/.synced  ## build sdist + wheel and prove them in fresh venvs (needs PGONCE_TEST_DSN)
	$(BIN)/python tools/dist_check.py --uv $(UV) --python $(PYTHON)

format: $(VENV)/.synced  ## apply ruff format and fixes, regenerate the sync code
	$(BIN)/python tools/gen_sync.py
	$(BIN)/ruff check --fix src tests bench tools faults
	$(BIN)/ruff format src tests bench tools faults

bench: $(VENV)/.synced  ## benchmarks; writes bench/results/latest.md
	$(BIN)/python -m bench $(BENCH_ARGS)

faults: $(VENV)/.synced  ## the fault and bad-input suite; writes faults/results/latest.md
	$(BIN)/python -m faults $(FAULTS_ARGS)

soak: $(VENV)/.synced  ## phases of stress at a fixed offered rate (SOAK_ARGS="--profile long ..."); writes faults/results/soak-<profile>.md
	$(BIN)/python -m faults.soak $(SOAK_ARGS)

sync: $(VENV)/.synced

$(VENV)/.synced: pyproject.toml uv.lock | $(UV)
	$(UV) sync --frozen --all-extras --python $(PYTHON)
	@touch $@

$(CURDIR)/.boot/bin/uv:
	$(PYTHON) -m venv $(CURDIR)/.boot
	$(CURDIR)/.boot/bin/python -m pip install --quiet --disable-pip-version-check uv

clean:  ## remove the venvs, the built site and distributions, and the local embedded database
	rm -rf .venv .boot .pgonce site dist
