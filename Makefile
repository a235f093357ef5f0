# Two entry points: `make demo` runs the SFT job on the embedded default,
# `make test` runs the test suite. Each creates or updates .venv first.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.txflow-installed

.PHONY: demo test test-fast venv clean bench

venv: $(STAMP)

# Reinstalls only when the pins change. torch first: the CPU wheel pip finds
# on this machine; resolved later, peft would pull a CUDA build of several GB.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	$(BIN)/python -m pip check
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/txflow run sft

test: $(STAMP)
	$(BIN)/python -m pytest -v

test-fast: $(STAMP)
	$(BIN)/python -m pytest -v -m "not e2e"

clean:
	rm -rf .txflow

# Discovery on S3 versus a bare recursive listing, same store, same run (target ratio <= 1.5).
bench: $(STAMP)
	$(BIN)/python scripts/bench_discovery.py --objects 10000
