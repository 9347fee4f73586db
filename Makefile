# `make demo` and `make test` are all a fresh clone needs (python3 only).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Worker processes for the test suite (pytest-xdist); CI machines have 2 cores.
JOBS   ?= 2

.PHONY: install test lint typecheck demo bench bench-quick clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check masked_multistep tests benchmarks tools
	$(MAKE) typecheck
	$(BIN)/python -m pytest -n $(JOBS) --durations=15

lint: $(STAMP)
	$(BIN)/ruff check masked_multistep tests benchmarks tools
	$(BIN)/ruff format --check masked_multistep tests benchmarks tools

# pyright on the package, tests/test_typing.py and the README's python blocks.
typecheck: $(STAMP)
	$(BIN)/python tools/typecheck.py

demo: $(STAMP)
	$(BIN)/python -m masked_multistep.demo $(ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/bench.py $(ARGS)

bench-quick: $(STAMP)
	$(BIN)/python benchmarks/bench.py --quick $(ARGS)

clean:
	rm -rf $(VENV) demo-output benchmarks/results .pytest_cache .hypothesis
