# Everything a fresh clone needs: `make demo` and `make test` create .venv and install on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The CPU build of torch lies on the CI machines' disk; torch stays an optional extra of the package.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test lint typecheck pytest bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet '$(TORCH_PIN)' || echo "torch not installable here: torch-path tests will be skipped"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvatlas demo

lint: $(STAMP)
	$(BIN)/ruff check kvatlas tests
	$(BIN)/ruff format --check kvatlas tests

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	scripts/ensure-redis.sh
	$(BIN)/python -m pytest -q

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/kvatlas bench keys

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
