# Set-up and main jobs. `make demo` and `make test` create the virtual environment themselves.
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed-stamp
# The project's own environment, created on first use. `make table1 PY=python` runs the main jobs with
# an environment of your own instead (the project installed in it), and creates nothing.
PY ?= $(VENV)/bin/python
ENV := $(if $(filter $(VENV)/bin/python,$(PY)),$(STAMP))

# Machines without an NVIDIA driver get torch 2.13.0, a small CPU build where pip finds one locally;
# GPU machines get pip's default (CUDA) build. Override with `make TORCH=... test`.
TORCH ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.4' || echo 'torch==2.13.0')
# The GPU image this project is measured on ships transformers 5.17: pin it for identical numerics.
TRANSFORMERS ?= transformers==5.17.0
# ... and Triton 3.6 (torch 2.11's). Linux x86-64 machines without a GPU also get it, in $(VENV)/gpu-triton
# beside the installed Triton, so that tests/test_kernels_compile.py compiles every kernel for sm_90 with
# both: the interpreter the CPU tests run the kernels through accepts code that a compiler may refuse.
# (Triton has no macOS build: there the kernels are not compiled, and not installed.)
GPU_TRITON ?= $(shell [ "$$(uname -sm)" = "Linux x86_64" ] && ! command -v nvidia-smi >/dev/null 2>&1 && echo 'triton==3.6.0')

RUNS ?= results/runs
# Table 1's baselines: lf_repo (the LongFlow authors' implementations, the paper's numbers) or paper
# (each baseline as its own paper defines it). ARGS: more overrides, e.g. ARGS="limit=8".
VARIANT ?= lf_repo
ARGS ?=
# Table 1 as one job after another (LAUNCHER empty), or one job per method x dataset (x shard) through a
# Hydra launcher: LAUNCHER=local_gpus runs them on this machine's GPUS GPUs, one each; LAUNCHER=slurm
# submits them as SLURM jobs of one GPU (its fields in ARGS: ARGS="hydra.launcher.partition=gpu").
# SHARDS=N splits every dataset among N jobs.
LAUNCHER ?=
GPUS ?= $(shell nvidia-smi -L 2>/dev/null | wc -l)
SHARDS ?= 1
TABLE1_DATASETS := aime24,aime25,amc,gpqa,gsm8k,math500,minerva,olympiad
LAUNCH := $(if $(LAUNCHER),hydra/launcher=$(LAUNCHER) dataset=$(TABLE1_DATASETS)) \
	$(if $(filter local_gpus,$(LAUNCHER)),$(if $(filter-out 0,$(GPUS)),hydra.launcher.gpus_per_node=$(GPUS))) \
	$(if $(filter-out 1,$(SHARDS)),shard=$(shell seq -s, -f '%g/$(SHARDS)' 0 $$(($(SHARDS) - 1))))

.PHONY: install test test-fast test-gpu demo demo-sweep table1 table fig1 fig3 fig4 figures results canary-suite-report lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet "$(TORCH)" "$(TRANSFORMERS)"
	$(VENV)/bin/pip install --quiet -e ".[dev,cluster]"  # cluster: the launchers, whose sweeps the tests run
	$(if $(GPU_TRITON),$(VENV)/bin/pip install --quiet --no-deps --upgrade --target $(VENV)/gpu-triton "$(GPU_TRITON)")
	touch $(STAMP)

# The suite runs in TEST_WORKERS processes (pytest-xdist; each file's tests in one process, which keeps
# the models that file caches), one thread each: on a 2-core machine, two workers of one thread ran a
# sample of the suite 1.7x faster than one process, and two of two threads each 2.8x slower than it.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1))")

test: $(ENV)  ## the whole suite (CPU; Triton kernels through its interpreter; GPU tests skip)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-fast: $(ENV)  ## without the end-to-end runs marked slow
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

# On a CUDA machine: the GPU tests and the kernel tests, the kernels compiled rather than interpreted; what
# to run after touching a kernel or the decode path. Spread test by test (one file holds most GPU tests),
# GPU_TEST_WORKERS processes sharing the GPU: 8 ran the GPU tests in about 200 s on an H200.
GPU_TEST_WORKERS ?= 8

test-gpu: $(ENV)  ## the tests marked gpu or kernels, on a CUDA GPU
	@$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu needs a CUDA GPU')"
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(GPU_TEST_WORKERS) --dist load -m "gpu or kernels"

# The demo writes only into $(DEMO) (git-ignored); results/demo/ holds the committed reference its
# last step compares it with (tests/test_demo.py).
DEMO := build/demo
REPORT := $(PY) -m evals.report
# Each demo starts from nothing: runs that other code made (a demo before an update) would be refused,
# not resumed (evals.run's `overwrite`, `allow_code_change`), and the demo takes minutes.
demo: $(ENV)  ## the canary model on 16 canary items, CPU: every method at three KV budgets, fidelity at the smallest; tables, plots
	rm -rf $(DEMO)
	$(PY) -m evals.run -m experiment=demo results_dir=$(DEMO)/runs
	$(PY) -m evals.run -m experiment=demo budget=96 fidelity=true method=streaming,h2o,vatp,rkv,longflow \
		results_dir=$(DEMO)/runs
	$(REPORT).table --runs $(DEMO)/runs --out $(DEMO)/table --stderr
	$(REPORT).table --runs $(DEMO)/runs --out $(DEMO)/table_agreement --metric fidelity.agreement --budget 96
	$(REPORT).table --runs $(DEMO)/runs --out $(DEMO)/table_kv_slots --metric peak_kv_slots
	$(REPORT).table --runs $(DEMO)/runs --out $(DEMO)/table_tokens_per_s --metric tokens_per_second
	$(REPORT).figures --runs $(DEMO)/runs --out $(DEMO)
	$(REPORT).results --runs $(DEMO)/runs --out $(DEMO)/results.csv
	$(PY) -m pytest -q -p no:cacheprovider tests/test_demo.py -k fresh_demo  # the tables above against results/demo/

DEMO_SWEEP := build/demo_sweep
demo-sweep: $(ENV)  ## the paper's figure layouts on the demo: two tiny models, every method at two budgets
	rm -rf $(DEMO_SWEEP)
	$(PY) -m evals.run -m model=tiny_qwen3,tiny_llama dataset=demo device=cpu generation.max_new_tokens=128 \
		method=vanilla,streaming,h2o,vatp,rkv,longflow budget=48,96 limit=3 results_dir=$(DEMO_SWEEP)/runs
	$(REPORT).table --runs $(DEMO_SWEEP)/runs --out $(DEMO_SWEEP)/table --stderr
	$(REPORT).figures --runs $(DEMO_SWEEP)/runs --out $(DEMO_SWEEP)
	$(REPORT).figures --runs $(DEMO_SWEEP)/runs --out $(DEMO_SWEEP) --only sizes --budget 96
	$(REPORT).results --runs $(DEMO_SWEEP)/runs --out $(DEMO_SWEEP)/results.csv

# Table 1 in two phases: the full cache first, then the methods, which copy its record of every item
# they cannot compress (experiment=table1 sets reuse_full_cache=exact; evals/reuse.py).
TABLE1_METHODS := streaming,h2o,vatp,rkv,longflow
table1: $(ENV)  ## the paper's Table 1: R1-Distill-Llama-8B, budget 2400, every method, eight datasets (GPU + hub)
	$(PY) -m evals.run -m experiment=table1 method=vanilla results_dir=$(RUNS) $(LAUNCH) $(ARGS)
	$(PY) -m evals.run -m experiment=table1 method=$(TABLE1_METHODS) method.variant=$(VARIANT) results_dir=$(RUNS) \
		$(LAUNCH) $(ARGS)
	$(REPORT).table --runs $(RUNS) --out results/table1 --model r1_distill_llama_8b --generation lf_repo
	$(REPORT).figures --runs $(RUNS) --out results/table1 --model r1_distill_llama_8b --generation lf_repo
	$(REPORT).results --runs $(RUNS) --out results/table1_results.csv --model r1_distill_llama_8b \
		--generation lf_repo

# `make table` and `make figures` report on every run under RUNS, or with SWEEP=DIR exactly one sweep's
# runs (DIR/sweep.json); FILTERS narrows them, e.g. FILTERS="--method h2o --budget 96".
SWEEP ?=
FILTERS ?=
SOURCE = $(if $(SWEEP),--sweep $(SWEEP),--runs $(RUNS)) $(FILTERS)
table: $(ENV)  ## a table of whatever runs exist (SWEEP=DIR: of one sweep; FILTERS="--method h2o ...")
	$(REPORT).table $(SOURCE) --out results/table

figures: $(ENV)  ## budget-sweep and output-length figures of whatever runs exist (SWEEP=, FILTERS= as for table)
	$(REPORT).figures $(SOURCE) --out results

# The paper's Figure 4 from whatever runs exist: accuracy across model sizes, at one KV budget (BUDGET=N
# when the runs have several).
BUDGET ?=
fig4: $(ENV)
	$(REPORT).figures --runs $(RUNS) --out results/fig4 --only sizes $(if $(BUDGET),--budget $(BUDGET))

results: $(ENV)  ## every run's metrics in one long-format CSV (one row per run x metric)
	$(REPORT).results --runs $(RUNS) --out results/results.csv

# The canary suite's report from its runs (results/canary_suite/runs, made as its README says) and its
# recall files: tables with paired intervals, the heatmaps, the reversals against the state family.
SUITE := results/canary_suite
canary-suite-report: $(ENV)  ## the canary suite's tables, heatmaps and order report from its runs and recall files
	$(REPORT).table --runs $(SUITE)/runs --out $(SUITE)/table --bootstrap 10000
	$(REPORT).table --runs $(SUITE)/runs --out $(SUITE)/table_vs_best --bootstrap 10000 --paired-against best
	$(REPORT).table --recall $(SUITE)/recall/recall_*.csv --metric recall_layers --out $(SUITE)/table_recall_layers \
		--bootstrap 10000
	$(REPORT).table --recall $(SUITE)/recall/recall_*.csv --metric recall_layer0 --out $(SUITE)/table_recall_layer0 \
		--bootstrap 10000
	$(REPORT).figures --runs $(SUITE)/runs --out $(SUITE) --only heatmap --bootstrap 10000
	$(REPORT).figures --recall $(SUITE)/recall/recall_*.csv --metric recall_layers --out $(SUITE) --only heatmap \
		--bootstrap 10000
	$(REPORT).order --runs $(SUITE)/runs --reference state --out $(SUITE)/order

fig1: $(ENV)  ## decode-attention microbenchmark (the paper's Figure 1); needs a CUDA GPU
	$(PY) -m evals.bench.attention --out results

fig3: $(ENV)  ## decode throughput vs batch size and the largest batch per method (the paper's Figure 3); needs a CUDA GPU
	$(PY) -m evals.bench.throughput --out results

lint: $(ENV)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) $(DEMO) $(DEMO_SWEEP) .pytest_cache
