# Two commands do all the set-up on a fresh machine with Python 3.11:
#   make serve   creates .venv, installs the pinned dependencies, starts the service (API + embedded Redis + worker)
#   make test    the same set-up, then the whole test suite
# and two guard rails, which add the pinned dev tools (requirements-dev.lock) to the same .venv:
#   make lint       ruff, then the import contracts (lint-imports; [tool.ruff] and [tool.importlinter] in pyproject.toml)
#   make typecheck  mypy ([tool.mypy] in pyproject.toml)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEVSTAMP := $(VENV)/.installed-dev

.PHONY: install install-dev browser serve test test-gpu lint typecheck clean

# pyproject.toml is a prerequisite because the editable install writes the console scripts (aotc, aotc-server,
# aotc-worker) and the package metadata (dependencies, extras) from it.
# Compile workers run each compile and check in a bubblewrap sandbox (worker/isolation.py), and the C++ loader
# example (examples/cpp, built by tests/e2e/test_cpp_loader.py) checks signatures with OpenSSL's libcrypto: install
# bwrap and libssl-dev as root where they are missing; anyone else is told how (or runs with AOTC_SANDBOX=off, for
# trusted models only). Without libssl-dev only the C++ example's test fails, so that alone is a warning.
$(STAMP): requirements.lock pyproject.toml
	@missing=; \
	command -v bwrap >/dev/null || [ "$$AOTC_SANDBOX" = off ] || missing=bubblewrap; \
	[ -e /usr/include/openssl/evp.h ] || missing="$${missing:+$$missing }libssl-dev"; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	elif [ "$$missing" = libssl-dev ]; then \
		echo "aotc: the C++ example (examples/cpp) needs OpenSSL's headers: sudo apt-get install libssl-dev" >&2; \
	else \
		echo "aotc: workers sandbox their compiles with bubblewrap, which is not installed. Install it as root" \
			"(sudo apt-get install $$missing), or set AOTC_SANDBOX=off to run compiles unconfined (trusted models only)." >&2; \
		exit 1; \
	fi
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

$(DEVSTAMP): requirements-dev.lock $(STAMP)
	$(BIN)/python -m pip install -q -r requirements-dev.lock
	touch $(DEVSTAMP)

install: $(STAMP)

install-dev: $(DEVSTAMP)

serve: $(STAMP)
	$(BIN)/aotc-server $(ARGS)

# The web console's tests (tests/ui) drive Debian's chromium through Playwright (Playwright's own browser download
# cannot work here). Only `make test` needs it: installed as root where it is missing; anyone else is told how, and
# without it only those tests fail.
browser:
	@command -v chromium >/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then \
			DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
		else \
			echo "aotc: the console's tests (tests/ui) need Debian's chromium: sudo apt-get install chromium" >&2; \
		fi; }

# Two test files at a time, in two pytest-xdist processes: run one at a time, the suite (real compiles, mostly on one
# core) kept 2 cores about 55% busy. A file stays in one process (its module fixtures are built once); ARGS="-n 0"
# runs serially.
test: $(STAMP) browser
	$(BIN)/python -m pytest -n 2 --dist loadfile $(ARGS)

# On a machine with a CUDA GPU (see docs/development.md, "On a GPU").
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -m gpu $(ARGS)

# Both steps run, so one report shows every finding; the target fails if either does. `make lint ARGS=--fix` fixes
# what ruff can.
lint: $(DEVSTAMP)
	@rc=0; \
	$(BIN)/ruff check $(ARGS) . || rc=1; \
	$(BIN)/lint-imports || rc=1; \
	exit $$rc

# mypy over service/, compiler/, worker/ and client/.
typecheck: $(DEVSTAMP)
	$(BIN)/python -m mypy $(ARGS)

clean:
	rm -rf $(VENV) .aotc .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
