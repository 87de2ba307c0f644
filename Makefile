# Two commands on a fresh machine with only Python:  make demo  /  make test
PYTHON ?= python3
VENV ?= .venv
# The tested torch. Installed first and on its own, so a CPU machine never pulls CUDA packages
# (an unpinned `torch` resolves to the newest CUDA build, several GB).
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test lint format bench bench-gpu bench-check bench-gpu-prepare clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

DEMO := outputs/demo
demo: install
	rm -rf $(DEMO)
	$(BIN)/python create_seed_checkpoint.py --config configs/debug.toml --output $(DEMO)/seed
	$(BIN)/seedckpt plan --config configs/debug.toml --world-size 4
	OMP_NUM_THREADS=1 $(BIN)/seedckpt launch --standalone --nproc-per-node 4 train.py --config configs/debug.toml \
		--checkpoint.seed_checkpoint $(DEMO)/seed --checkpoint.folder $(DEMO)/checkpoints --job.dump_folder $(DEMO)
	$(BIN)/seedckpt inspect $(DEMO)/checkpoints/step-100 | head -n 12
	$(BIN)/seedckpt convert $(DEMO)/checkpoints/step-100 $(DEMO)/hf --to hf
	$(BIN)/seedckpt diff $(DEMO)/checkpoints/step-100 $(DEMO)/hf | tail -n 1
	@echo "--- SFT of the pretrained demo model on configs/sft_demo/chats.jsonl (loss on assistant tokens only)"
	OMP_NUM_THREADS=1 $(BIN)/seedckpt launch --standalone --nproc-per-node 4 train.py --config configs/sft_debug.toml \
		--finetune.pretrained $(DEMO)/checkpoints/step-100 --checkpoint.folder $(DEMO)/sft --job.dump_folder $(DEMO)/sft
	$(BIN)/seedckpt convert $(DEMO)/sft/step-60 $(DEMO)/sft_hf --to hf
	@echo "--- OSFT of the same model and chats: 75 % of each matrix's singular directions stay frozen"
	OMP_NUM_THREADS=1 $(BIN)/seedckpt launch --standalone --nproc-per-node 4 train.py --config configs/sft_debug.toml \
		--finetune.mode osft --finetune.pretrained $(DEMO)/checkpoints/step-100 \
		--checkpoint.folder $(DEMO)/osft --job.dump_folder $(DEMO)/osft
	$(BIN)/seedckpt convert $(DEMO)/osft/step-60 $(DEMO)/osft_hf --to hf
	$(BIN)/seedckpt diff $(DEMO)/osft/step-60 $(DEMO)/osft_hf | tail -n 2
	@echo
	@echo "demo outputs:"
	@echo "  seed checkpoint      $(DEMO)/seed"
	@echo "  training checkpoints $(DEMO)/checkpoints/step-50, step-100"
	@echo "  per-step metrics     $(DEMO)/metrics.jsonl"
	@echo "  Hugging Face export  $(DEMO)/hf (loads with transformers' LlamaForCausalLM)"
	@echo "  SFT checkpoints      $(DEMO)/sft/step-30, step-60 (metrics: $(DEMO)/sft/metrics.jsonl)"
	@echo "  SFT export           $(DEMO)/sft_hf (model + tokenizer, loads with transformers)"
	@echo "  OSFT checkpoints     $(DEMO)/osft/step-30, step-60 (SVD factors; osft_leak in $(DEMO)/osft/metrics.jsonl)"
	@echo "  OSFT export (dense)  $(DEMO)/osft_hf"

test: install lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=20 tests

# ruff's lint rules and format (pyproject.toml); `make format` rewrites the tree in that format
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Every CPU figure the docs cite (benchmarks/suite.py --device cpu; about half an hour on 2 cores), into
# benchmarks/results/cpu-<date>.json; BENCH_ARGS="--parts seed,load" for some of them.
bench: install
	$(BIN)/python benchmarks/suite.py --device cpu $(BENCH_ARGS)

clean:
	rm -rf $(VENV) outputs .pytest_cache

# Every GPU figure in one command of under 10 minutes (benchmarks/suite.py: the rows by issue 47's
# priority, each within what is left of 570 s; what does not fit is recorded as skipped), into
# benchmarks/results/gpu-<date>T<time>.json, rewritten after every row. GPU_SUITE_ARGS="--parts a,b"
# for some rows. On a machine without CUDA it says what it would measure and exits 0. On a lent GPU
# machine without network or venv it runs with the image's python3 and installs the wheels
# bench-gpu-prepare fetched into GPU_WHEELS.
GPU_WHEELS ?= .gpu-wheels
GPU_PYTHON ?= $(shell test -x $(BIN)/python && echo $(BIN)/python || echo python3)
GPU_PYTHON_VERSION ?= 3.12
bench-gpu:
	$(GPU_PYTHON) benchmarks/suite.py --wheels $(GPU_WHEELS) $(GPU_SUITE_ARGS)

# Each GPU row's command on this CPU with tiny shapes, a step or two (4-5 min of CPU, 10-16 of wall on 2
# loaded cores; torchtitan's trainers, with the wheels, 1 and 2-4 more): a typo fails here rather than on
# the lent machine. As it runs them: CHECK_PYTHON=<a Python 3.12 venv with the image's torch 2.11>
# GPU_SUITE_ARGS="--wheels .gpu-wheels" (the project's venv is installed only where it runs them).
CHECK_PYTHON ?= $(BIN)/python
bench-check: $(if $(filter $(BIN)/python,$(CHECK_PYTHON)),install)
	$(CHECK_PYTHON) benchmarks/suite.py --dry-run $(GPU_SUITE_ARGS)

# On a machine with network: the wheels the GPU image lacks, for its Python (GPU_PYTHON_VERSION), into
# GPU_WHEELS (git-ignored; emptied first: one version of each) to travel with the tree -- crc32c;
# pytest and its dependencies; torchtitan 0.3.0 (moe_block's peer layer) and those of its dependencies
# the image has not: tyro (docstring-parser, typeguard), spmd_types, torchdata, torch_checkpointing,
# datasets (dill, multiprocess); and in GPU_WHEELS/torchtitan_peer/, installed for that row alone,
# torchtitan 0.2.2, whose trainer imports on the image's torch 2.11 (0.3.0's needs 2.13). 5.1 MB in all.
GPU_PIP_DOWNLOAD = $(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: \
	--python-version $(GPU_PYTHON_VERSION) --implementation cp \
	--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
bench-gpu-prepare:
	rm -rf $(GPU_WHEELS)
	$(GPU_PIP_DOWNLOAD) -d $(GPU_WHEELS) crc32c pytest pluggy iniconfig pygments packaging \
		torchtitan==0.3.0 tyro docstring-parser typeguard spmd_types==0.2.3 torchdata torch_checkpointing \
		"datasets>=3.6,<4.8" "dill>=0.3,<0.4.1" "multiprocess<0.70.19"
	$(GPU_PIP_DOWNLOAD) -d $(GPU_WHEELS)/torchtitan_peer torchtitan==0.2.2
