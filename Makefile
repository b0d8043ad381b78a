# Two entry points for a newcomer: `make serve` and `make test`. Both build .venv on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PACKAGES := engine router prefill_worker decode_worker kv_transfer

.PHONY: serve test lint typecheck unit bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/pdserve serve

test: lint typecheck unit

lint: $(STAMP)
	$(BIN)/ruff check $(PACKAGES) bench tests proto
	$(BIN)/ruff format --check $(PACKAGES) bench tests proto

typecheck: $(STAMP)
	$(BIN)/mypy $(PACKAGES)

# two processes: much of the suite waits on Ray actors and servers, which the other fills
unit: $(STAMP)
	$(BIN)/pytest -q -p no:cacheprovider -n 2

bench: $(STAMP)
	$(BIN)/python -m bench.offline_throughput

clean:
	rm -rf $(VENV)
