# Two entry points on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build is what this project's CI machines carry; override for CUDA machines.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install system-deps demo test test-fast lint fmt clean

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# The tests start a real redis-server (metadata backend, services e2e); Debian's package provides it.
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else echo "install redis-server (Debian/Ubuntu: sudo apt-get install redis-server), then run make again" >&2; \
	    exit 1; fi; }

demo: install
	$(PY) -m client.demo

# Bytecode caches on for the tests even where the shell turns them off (PYTHONDONTWRITEBYTECODE=1): the
# assertion rewrites of the test modules and plugins, and every subprocess's imports of the project, are then
# compiled once instead of on every run (about 6 s of each collection on 2 cores).
TEST_ENV := PYTHONDONTWRITEBYTECODE=

# Every test (CPU only; Triton kernels in interpreter mode).
test: install system-deps
	$(TEST_ENV) $(PY) -m pytest -q

# The inner loop: everything but the tests marked slow (under 5 minutes on 2 cores).
test-fast: install system-deps
	$(TEST_ENV) $(PY) -m pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

fmt: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
