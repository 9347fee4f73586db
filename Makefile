# `make demo` and `make test` are all a fresh clone needs (python3 only).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# One stamp per extra installed into .venv: `make demo` installs only the demo's
# extra, `make docs` the docs', `make test` (and the rest) the development stack,
# which holds both: where it is installed, `make demo` and `make docs` use it (and
# bring it up to date) instead of installing their own extra again.
STAMP      := $(VENV)/.installed-dev
DEMO_STAMP := $(VENV)/.installed-demo
DOCS_STAMP := $(VENV)/.installed-docs
DEMO_NEEDS := $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))
DOCS_NEEDS := $(if $(wildcard $(STAMP)),$(STAMP),$(DOCS_STAMP))
# Worker processes for the test suite (pytest-xdist); CI machines have 2 cores.
JOBS   ?= 2
# What `make lint` (and `make test`) check with ruff.
LINTED := masked_multistep tests benchmarks docs tools examples notebooks/execute.py

.PHONY: help install test test-latest lint typecheck demo docs bench bench-quick bench-dp bench-compile clean

# The first target, what a bare `make` runs: the list below.
help:
	@echo "make demo           the bug and the fix: trains a tiny LM three ways (ARGS=--help for options; installs the demo's extra into .venv)"
	@echo "make test           ruff, pyright and the whole test suite (installs the development stack into .venv)"
	@echo "make install        only the development stack, into .venv"
	@echo "make test-latest    the test suite against the newest releases pip finds for PYTHON (no pins), in .venv-latest"
	@echo "make lint           ruff check and ruff format --check"
	@echo "make typecheck      pyright on the package, tools/, tests/test_typing.py and the README's examples"
	@echo "make docs           the HTML docs (Sphinx) in docs/_build/html"
	@echo "make bench          benchmarks against optax.MultiSteps (ARGS=--help for options)"
	@echo "make bench-quick    the same, short: small sizes, under a minute"
	@echo "make bench-dp       data parallel across two processes on 127.0.0.1"
	@echo "make bench-compile  start-up cost: trace and compile times against optax.MultiSteps"
	@echo "make clean          removes .venv and everything built or cached"

install: $(STAMP)

# A PYTHON= that does not run (not installed, or a pyenv shim of a version not
# installed) is named, with the Pythons that do.
define PYTHON_FOUND
@$(PYTHON) -c '' >/dev/null 2>&1 || { \
	found=$$(for v in 3.11 3.12 3.13 3.14; do \
		python$$v -c '' >/dev/null 2>&1 && printf ' python%s' $$v; done); \
	echo "$(PYTHON) was not found (or does not run). Name an installed Python 3.11" \
	"to 3.14 with PYTHON= (these run here:$${found:- none})."; exit 1; }
endef

# A python3 older than 3.11, or newer than the pinned jaxlib has wheels for
# (constraints.txt), is refused with a hint. A .venv is made again where it has
# no pip (an interrupted install) or a Python outside 3.11 to 3.14, or where
# nothing was ever installed into it and it is of another Python version than
# $(PYTHON)'s (a retry with another PYTHON= after a failed install); a .venv
# that holds an install keeps its Python (`make clean` to change it).
PY_MINOR := import sys; print(*sys.version_info[:2], sep=".")
$(STAMP) $(DEMO_STAMP) $(DOCS_STAMP): $(VENV)/.installed-%: setup.cfg pyproject.toml constraints.txt
	$(PYTHON_FOUND)
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
		echo "masked_multistep needs Python >= 3.11; $(PYTHON) is $$($(PYTHON) -V 2>&1)." \
		"Run e.g. \`make $(MAKECMDGOALS) PYTHON=python3.11\`."; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info >= (3, 15))' || { \
		echo "The versions make installs (constraints.txt: $$(grep '^jaxlib==' constraints.txt))" \
		"have wheels for Python 3.11 to 3.14; $(PYTHON) is $$($(PYTHON) -V 2>&1). Run e.g." \
		"\`make $(MAKECMDGOALS) PYTHON=python3.14\`."; exit 1; }
	@v=$$($(BIN)/python -c 'import pip; $(PY_MINOR)' 2>/dev/null); \
	case "$$v" in 3.11|3.12|3.13|3.14) ;; *) v= ;; esac; \
	if [ -z "$$v" ] || { ! ls $(VENV)/.installed-* >/dev/null 2>&1 \
			&& [ "$$v" != "$$($(PYTHON) -c '$(PY_MINOR)')" ]; }; then \
		echo "$(PYTHON) -m venv --clear $(VENV)"; $(PYTHON) -m venv --clear $(VENV); fi
	@echo "Installing masked_multistep[$*] and its pinned dependencies into $(VENV)..."
	@$(BIN)/python -m pip install -q --upgrade pip
	@# uv installs the same pinned set several times faster than pip; where uv
	@# cannot be installed (no wheel for the platform), pip does it. Compiled to
	@# bytecode as pip does: every process (test workers, notebook kernels)
	@# would otherwise compile jax's and flax's sources again on import.
	@if $(BIN)/python -m pip install -q -c constraints.txt uv 2>/dev/null; then \
		$(BIN)/python -m uv pip install -q --compile-bytecode \
			--python $(BIN)/python -c constraints.txt -e ".[$*]"; \
	else \
		echo "(uv cannot be installed here: installing with pip)"; \
		$(BIN)/python -m pip install -q -c constraints.txt -e ".[$*]"; \
	fi
	@touch $@

# MASKED_MULTISTEP_TESTS_LEGACY_EMITTERS: the suite's own programs compile with
# XLA:CPU's legacy emitters, about a third faster (tests/conftest.py).
TEST_ENV := MASKED_MULTISTEP_TESTS_LEGACY_EMITTERS=1

test: $(STAMP)
	$(MAKE) lint
	$(MAKE) typecheck
	$(TEST_ENV) $(BIN)/python -m pytest -n $(JOBS) --durations=15

# The suite against what `pip install` gives a user today: the newest releases the
# requirements allow for $(PYTHON) (jax 0.12 needs Python >= 3.12), not the pins of
# constraints.txt, installed afresh into a venv of its own on every run.
LATEST := .venv-latest
test-latest:
	$(PYTHON_FOUND)
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
		echo "masked_multistep needs Python >= 3.11; $(PYTHON) is $$($(PYTHON) -V 2>&1)."; exit 1; }
	$(PYTHON) -m venv --clear $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	if $(LATEST)/bin/python -m pip install -q uv; then \
		$(LATEST)/bin/python -m uv pip install -q --compile-bytecode --upgrade \
			--python $(LATEST)/bin/python -e ".[dev]"; \
	else \
		$(LATEST)/bin/python -m pip install -q --upgrade -e ".[dev]"; \
	fi
	@$(LATEST)/bin/python -c 'import sys, jax, flax, optax; print("Python", sys.version.split()[0], \
		"jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__)'
	$(TEST_ENV) $(LATEST)/bin/python -m pytest -n $(JOBS) --durations=15

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

# pyright on the package, tools/, tests/test_typing.py and the README's python blocks.
typecheck: $(STAMP)
	$(BIN)/python tools/typecheck.py

demo: $(DEMO_NEEDS)
	$(BIN)/python -m masked_multistep.demo $(ARGS)

# The stored notebooks are rendered as they are; `make test` executes them.
docs: $(DOCS_NEEDS)
	$(BIN)/python -m sphinx -W --keep-going -b html docs docs/_build/html
	@echo "open docs/_build/html/index.html"

bench: $(STAMP)
	$(BIN)/python benchmarks/bench.py $(ARGS)

bench-quick: $(STAMP)
	$(BIN)/python benchmarks/bench.py --quick $(ARGS)

# Two processes on 127.0.0.1 (gloo): one gradient reduction per window or per microbatch.
bench-dp: $(STAMP)
	$(BIN)/python benchmarks/bench_dp.py $(ARGS)

bench-compile: $(STAMP)
	$(BIN)/python benchmarks/bench_compile.py $(ARGS)

clean:
	rm -rf $(VENV) $(LATEST) demo-output train-lm-output benchmarks/results .pytest_cache .hypothesis \
		docs/_build docs/notebooks docs/benchmarks dist build *.egg-info .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
