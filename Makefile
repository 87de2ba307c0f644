# Two commands on a fresh machine with only Python:  make demo  /  make test
PYTHON ?= python3
VENV ?= .venv
# The tested torch. Installed first and on its own, so a CPU machine never pulls CUDA packages
# (an unpinned `torch` resolves to the newest CUDA build, several GB).
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: install
	$(BIN)/python create_seed_checkpoint.py --config configs/debug.toml --output outputs/demo/seed --force
	$(BIN)/seedckpt inspect outputs/demo/seed
	$(BIN)/seedckpt plan --config configs/debug.toml --world-size 4

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests

bench: install
	$(BIN)/python benchmarks/seed.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
