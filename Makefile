# Two entry points, each sets itself up on a fresh machine:
#   make demo   - the main job
#   make test   - the test suite (what CI runs)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test bench plan clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pin torch first: 2.13.0 installs a CPU build from local disk; anything unpinned pulls CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q torch==2.13.0 -e '.[test,plot]'
	rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	$(BIN)/python -m ragged_fsdp demo

test: $(STAMP)
	$(BIN)/python -m pytest tests

bench: $(STAMP)
	$(BIN)/python -m ragged_fsdp bench

plan: $(STAMP)
	$(BIN)/python -m ragged_fsdp plan --model llama3-70b,gpt-oss-120b,deepseek-v3 --world 1024,8192 --granularity row,rows:128 --suggest

clean:
	rm -rf $(VENV) out build src/*.egg-info
