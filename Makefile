# Two commands do all the set-up: `make demo` and `make test` (each creates .venv when needed).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of torch lies on this machine's disk; pin it so a fresh venv never pulls a CUDA build.
# On a GPU machine: make install TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install test demo clean

$(BIN)/skillswarm: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[test]'
	@touch $(BIN)/skillswarm

install: $(BIN)/skillswarm

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The whole swarm on 127.0.0.1 on the nano model (built and cached on first use); see README.
DEMO_ARGS ?=
demo: install
	$(BIN)/skillswarm demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
