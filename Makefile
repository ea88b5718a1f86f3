# Two entry points, each sets itself up on a fresh machine:
#   make demo   - the main job
#   make test   - the test suite and the strict docs build (what CI runs)
# and `make docs` builds the documentation site into build/site.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test docs test-torch214 test-torch215 bench bench-torch215 plan clean gpu-check

# A second torch: a representative subset of the suite (placement, engine numerics and patterns,
# the private torch calls of fsdp/torch_private.py,
# checkpoints, optimizers) on torch 2.14.1, in a venv of its own. Its wheel lies on local disk (a
# CUDA build; it runs on the CPU); only pytest and hypothesis come with it. CI runs the same subset
# on torch 2.15.0 instead (test-torch215, below); this target stays for a manual check.
VENV214 := .venv-torch214
STAMP214 := $(VENV214)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
TORCH214_TESTS := tests/test_placement.py tests/test_placement_dist.py tests/test_fsdp_numerics.py \
	tests/test_patterns_engine.py tests/test_checkpoint.py tests/test_optim_api.py tests/test_torch_private.py

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pin torch first: 2.13.0 installs a CPU build from local disk; anything unpinned pulls CUDA.
	$(BIN)/pip install -q torch==2.13.0
	# quant (torchao): the torchao cases of tests/test_quant_*.py and test_quantized_weights.py run, not skip
	$(BIN)/pip install -q torch==2.13.0 -e '.[test,plot,docs,quant]'
	rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	$(BIN)/python -m ragged_fsdp demo

test: $(STAMP)
	$(BIN)/python -m pytest tests --durations=25
	# the engine's tests again on the ordering-checking device (tests/_checking_device.py), W = 2
	RAGGED_FSDP_CHECK_ORDER=1 $(BIN)/python -m pytest -q tests/test_patterns_engine.py \
		tests/test_fsdp_numerics.py tests/test_fsdp_mesh.py tests/test_optim_dist.py
	$(MAKE) docs

# --strict: a broken link, a page missing from the nav or a missing API object fails the build
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

$(STAMP214): pyproject.toml
	test -x $(VENV214)/bin/python || $(PY) -m venv $(VENV214)
	$(VENV214)/bin/pip install -q torch==2.14.1
	$(VENV214)/bin/pip install -q torch==2.14.1 'pytest>=8' 'hypothesis>=6' -e .
	rm -f $(VENV214)/.installed-* && touch $@

test-torch214: $(STAMP214)
	$(VENV214)/bin/python -c "import torch; assert torch.__version__.startswith('2.14.1'), torch.__version__"
	$(VENV214)/bin/python -m pytest $(TORCH214_TESTS)

# torch 2.15.0, the newest release: the same subset. Only PyPI has its wheel (a CUDA build, 539 MB,
# whose libtorch_cpu.so links libcudart and libcupti and libtorch_cuda.so most CUDA libraries, so the
# nvidia-* wheels it depends on cannot be left out: `import torch` fails without them). The machine's
# pip constraints file caps torch at 2.14.1; PIP_CONSTRAINT=/dev/null lifts it for this venv only
# (an empty PIP_CONSTRAINT does not).
VENV215 := .venv-torch215
STAMP215 := $(VENV215)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

$(STAMP215): pyproject.toml
	test -x $(VENV215)/bin/python || $(PY) -m venv $(VENV215)
	PIP_CONSTRAINT=/dev/null $(VENV215)/bin/pip install -q torch==2.15.0
	PIP_CONSTRAINT=/dev/null $(VENV215)/bin/pip install -q torch==2.15.0 'pytest>=8' 'hypothesis>=6' -e .
	rm -f $(VENV215)/.installed-* && touch $@

test-torch215: $(STAMP215)
	$(VENV215)/bin/python -c "import torch; assert torch.__version__.startswith('2.15.0'), torch.__version__"
	$(VENV215)/bin/python -m pytest $(TORCH214_TESTS)

bench: $(STAMP)
	$(BIN)/python -m ragged_fsdp bench

# the side-by-side bench against torch 2.15.0's FSDP2 (and FSDP1, DDP), short form
bench-torch215: $(STAMP215)
	$(VENV215)/bin/python -m ragged_fsdp bench --quick

plan: $(STAMP)
	$(BIN)/python -m ragged_fsdp plan --model llama3-70b,gpt-oss-120b,deepseek-v3 --world 1024,8192 --granularity row,rows:128 --suggest

# On the lent GPU machine (its own python3 and torch 2.11, no venv, nothing installable):
# the CUDA tests and a W=1 CUDA bench against FSDP2. Meant to finish in under 5 minutes.
gpu-check:
	PYTHONPATH=src python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
	PYTHONPATH=src timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_fsdp_cuda.py
	mkdir -p $${OUT:-out} && PYTHONPATH=src timeout 240 python3 benchmarks/gpu.py --json $${OUT:-out}/gpu_bench.json
	PYTHONPATH=src timeout 180 python3 benchmarks/gpu_calibrate.py --out $${OUT:-out}/gpu_profile.json

clean:
	rm -rf $(VENV) $(VENV214) $(VENV215) out build src/*.egg-info
