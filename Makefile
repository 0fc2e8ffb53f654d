# The two commands: `make run` (try it) and `make test` (lint and the whole suite). Both start from
# a fresh clone: they create .venv and install what is missing. `make test-fast` runs the unit tests
# alone (no processes, under a minute).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build that lies on disk here. Users with GPUs install their own torch first.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
COMPILED := $(VENV)/.compiled
# The last released proto contract, kept as a committed buf image so a shallow clone can check it:
# `make test` fails on a change to protos/ that breaks wire or source compatibility with it
# (`buf breaking`, rules in protos/buf.yaml). Move it forward only when a new contract is released:
# `make release-contract REF=<commit>` (today's image is b37e875's).
RELEASED_CONTRACT := released-contract.json

.PHONY: install run test test-fast lint style typecheck suite protos breaking release-contract bench clean

install: $(STAMP)

# pip would compile every file of every package it installs (transformers alone has thousands, few of
# them ever imported: 33 s of a fresh install here); instead what the services import is compiled
# by importing it once ($(COMPILED): what `make run` and the suite start with, while `make test` runs
# mypy beside it), and anything else at its first import. Bytecode is written in make's recipes
# even where the environment says not to (PYTHONDONTWRITEBYTECODE), or every process would compile
# torch again (7 s of CPU each).
export PYTHONDONTWRITEBYTECODE :=
SERVICE_MODULES := runner_service.main runner_service.core runner_service.service worker_service.main clients

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet --no-compile "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet --no-compile -e ".[runner,test]"
	touch $(STAMP)

$(COMPILED): $(STAMP)
	$(BIN)/python -c "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]" $(SERVICE_MODULES)
	touch $(COMPILED)

# Flags for deploy/pod.py, then the worker's after `--`: make run ARGS="--model small -- --max-batch-size 4"
ARGS ?=

run: $(COMPILED)
	$(BIN)/python deploy/pod.py $(ARGS)

protos: install
	$(BIN)/python protos/generate.py

lint: style typecheck

style: install
	$(BIN)/ruff check .
	cd protos && ../$(BIN)/buf lint

typecheck: install
	$(BIN)/mypy

breaking: install
	cd protos && ../$(BIN)/buf breaking --against $(RELEASED_CONTRACT)

release-contract: install
	cd protos && ../$(BIN)/buf build '../.git#ref=$(REF),subdir=protos' --exclude-source-info -o $(RELEASED_CONTRACT)

# pytest-xdist workers for `make test`, each taking whole modules (--dist loadfile), so a module's
# processes stay in one worker. On two cores, with mypy beside them (2026-12-06, one checkout, one
# run after another): 2 took 390 s, 3 took 358 s, 4 took 371 and 377 s; again after the runner
# zygote's warm-up, without mypy: 3 took 286 s, 4 took 301 s.
TEST_WORKERS ?= 3

# mypy runs beside the suite: it is one process on one core (51 s on a clean clone), the suite's
# workers take both cores, and `make test` fails when either fails.
test: style breaking
	$(BIN)/python protos/generate.py --check
	$(MAKE) --no-print-directory -j2 typecheck suite

suite: $(COMPILED)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

test-fast: install
	$(BIN)/python -m pytest -m unit

# The last two exit 1 on a missed target: both run, and the target fails after them if either missed.
bench: install
	$(BIN)/pip install --quiet --no-compile -e ".[runner,test,bench]"
	$(BIN)/python benchmarks/bench.py
	$(BIN)/python benchmarks/bench_weights.py
	$(BIN)/python -m benchmarks.bench_serving
	$(BIN)/python -m benchmarks.bench_serving --model shapes
	$(BIN)/python -m benchmarks.bench_schedule
	$(BIN)/python -m benchmarks.bench_video
	$(BIN)/python -m benchmarks.bench_group
	$(BIN)/python -m benchmarks.bench_overhead
	status=0; $(BIN)/python -m benchmarks.bench_shapes || status=1; \
	  $(BIN)/python -m benchmarks.bench_acceleration || status=1; exit $$status

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
