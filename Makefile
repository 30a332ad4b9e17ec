# Two commands do all the set-up: `make demo` and `make test` (each creates .venv when needed).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of torch lies on this machine's disk; pin it so a fresh venv never pulls a CUDA build.
# On a GPU machine: make install TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install sandbox-deps browser-deps test demo clean

$(BIN)/skillswarm: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[test]'
	@touch $(BIN)/skillswarm

# The python tool's sandbox runs model code under bubblewrap (see README, "The python sandbox"). As root
# on Debian/Ubuntu it is installed here; otherwise the command to install it is printed. Then one
# sandboxed run checks that this machine allows it (user namespaces), with what to do if not.
sandbox-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing bubblewrap (the python tool's sandbox)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; }; \
	  else \
	    echo "error: the python sandbox needs bubblewrap (bwrap): sudo apt-get install bubblewrap (Debian, Ubuntu)," \
	      "sudo dnf install bubblewrap (Fedora), sudo pacman -S bubblewrap (Arch), apk add bubblewrap (Alpine)" >&2; \
	    exit 1; \
	  fi; }

install: $(BIN)/skillswarm sandbox-deps
	@$(BIN)/skillswarm -q sandbox check >/dev/null

# The dashboard's test drives a real headless browser: Debian's chromium and its driver, installed here as
# root (CI); elsewhere that one test skips and says what to install.
browser-deps:
	@{ command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium and chromedriver (the dashboard test's browser)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 || \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } || \
	    echo "note: could not install chromium; the dashboard's browser test will skip"; \
	  else \
	    echo "note: the dashboard's browser test needs chromium and chromedriver (sudo apt-get install chromium chromium-driver); it skips without them"; \
	  fi; }

test: install browser-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The whole swarm on 127.0.0.1 on the nano model (built and cached on first use); see README.
DEMO_ARGS ?=
demo: install
	$(BIN)/skillswarm demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
