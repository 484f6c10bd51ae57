# Two commands do all the set-up on a fresh machine with Python 3.11:
#   make serve   creates .venv, installs the pinned dependencies, starts the service (API + embedded Redis + worker)
#   make test    the same set-up, then the whole test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install serve test test-gpu typecheck lint clean

$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/aotc serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

# On a machine with a CUDA GPU (see README, "Development").
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -m gpu $(ARGS)

# mypy over service/, compiler/, worker/ and client/ ([tool.mypy] in pyproject.toml). Dev-only: mypy is pinned
# in requirements-dev.lock, outside requirements.lock, so `make test` and CI do not install it.
typecheck: $(STAMP)
	$(BIN)/python -m pip install -q -r requirements-dev.lock
	$(BIN)/python -m mypy $(ARGS)

clean:
	rm -rf $(VENV) .aotc .pytest_cache
