# Two entry points, each sets itself up on a fresh machine:
#   make demo   - the main job
#   make test   - the test suite and the strict docs build (what CI runs)
# and `make docs` builds the documentation site into build/site.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test docs bench plan clean gpu-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pin torch first: 2.13.0 installs a CPU build from local disk; anything unpinned pulls CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q torch==2.13.0 -e '.[test,plot,docs]'
	rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	$(BIN)/python -m ragged_fsdp demo

test: $(STAMP)
	$(BIN)/python -m pytest tests
	$(MAKE) docs

# --strict: a broken link, a page missing from the nav or a missing API object fails the build
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

bench: $(STAMP)
	$(BIN)/python -m ragged_fsdp bench

plan: $(STAMP)
	$(BIN)/python -m ragged_fsdp plan --model llama3-70b,gpt-oss-120b,deepseek-v3 --world 1024,8192 --granularity row,rows:128 --suggest

# On the lent GPU machine (its own python3 and torch 2.11, no venv, nothing installable):
# the CUDA tests and a W=1 CUDA bench against FSDP2. Meant to finish in under 5 minutes.
gpu-check:
	PYTHONPATH=src python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
	PYTHONPATH=src timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_fsdp_cuda.py
	mkdir -p $${OUT:-out} && PYTHONPATH=src timeout 240 python3 -m ragged_fsdp.bench.gpu --json $${OUT:-out}/gpu_bench.json

clean:
	rm -rf $(VENV) out build src/*.egg-info
