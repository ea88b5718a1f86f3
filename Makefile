# Two entry points, each sets itself up on a fresh machine:
#   make demo        - the main job; installs only what it needs (torch, the package, matplotlib)
#   make test        - the test suite and the strict docs build (what CI runs); adds the test extras
# and `make test-quick` (a 3-minute subset that prints its pass count), `make docs` (the site
# into build/site).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SUM := $(shell cat pyproject.toml | cksum | cut -d' ' -f1)
STAMP_DEMO := $(VENV)/.demo-$(SUM)
STAMP := $(VENV)/.installed-$(SUM)
# CPU torch on every machine, as the README's Quick start says: PyPI's Linux wheel of torch is
# the CUDA build (about 900 MB of nvidia-* wheels besides torch), so torch comes from PyTorch's
# CPU index. --index-url rather than --extra-index-url: with both indexes pip takes whichever
# candidate ranks highest ("2.13.0+cpu" over "2.13.0", by the local-version rule), so which build
# arrives would depend on a sorting rule and on what each index holds; --index-url names the one
# source. Behind a mirror or proxy that serves PyPI only, that index cannot be reached: the
# fallback then installs the configured index's build and says so. --retries 2: an unreachable
# index fails in seconds, not after pip's five retries. (pip also reads find-links from its
# configuration: a local CPU wheel there is taken as well.)
TORCH := torch==2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
PIP := $(BIN)/pip
SHOW := --progress-bar on

.PHONY: demo test test-quick test-hf5 docs test-torch214 test-torch215 bench bench-torch215 plan clean gpu-check

$(STAMP_DEMO): pyproject.toml
	@echo "== [1/3] the virtual environment $(VENV)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@echo "== [2/3] $(TORCH), the CPU build (about 200 MB on a fresh machine)"
	$(PIP) install $(SHOW) --retries 2 $(TORCH) --index-url $(TORCH_CPU_INDEX) || \
		{ echo "!! $(TORCH_CPU_INDEX) could not be reached: installing $(TORCH) from the configured index (on Linux PyPI's wheel is the CUDA build, which also runs on the CPU)"; \
		  $(PIP) install $(SHOW) $(TORCH); }
	@echo "== [3/3] ragged_fsdp and matplotlib (the demo's plot)"
	$(PIP) install $(SHOW) $(TORCH) -e '.[plot]'
	rm -f $(VENV)/.demo-* && touch $@

# The test extras on top of the demo's set-up: pytest, hypothesis, the integrations (transformers,
# peft, bitsandbytes, torchtitan, triton, accelerate), the docs build, and torchao: its cases of
# tests/test_quant_*.py and test_quantized_weights.py run, not skip.
$(STAMP): $(STAMP_DEMO)
	@echo "== the test, docs and quant extras"
	$(PIP) install -q $(TORCH) -e '.[test,plot,docs,quant]'
	rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP_DEMO)
	$(BIN)/python -m ragged_fsdp demo

test: $(STAMP)
	$(BIN)/python -m pytest tests --durations=25
	# the engine's tests again on the ordering-checking device (tests/_checking_device.py), W = 2
	RAGGED_FSDP_CHECK_ORDER=1 $(BIN)/python -m pytest -q tests/test_patterns_engine.py \
		tests/test_fsdp_numerics.py tests/test_fsdp_mesh.py tests/test_optim_dist.py
	$(MAKE) docs

# A first check for a newcomer: the placement, planner, optimizer and start-up tests, one
# single-process file or one multi-rank launch each; under 3 minutes on a 2-core machine
# (docs/contributing.md has the measurement). No -q here: pytest's configuration already
# passes -q, and a second one drops the closing "N passed" line.
QUICK_TESTS := tests/test_import_cost.py tests/test_dbuffer.py tests/test_planner.py \
	tests/test_torch_optimizers.py tests/test_cli_plan.py
test-quick: $(STAMP)
	$(BIN)/python -m pytest $(QUICK_TESTS)

# --strict: a broken link, a page missing from the nav or a missing API object fails the build
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The subset a second torch runs (test-torch214, test-torch215): the placement (local and
# W = 2-4), engine numerics and patterns, checkpoints, the optimizer API, every private torch call
# (fsdp/torch_private.py), and torch FSDP2's contracts that torch's own code calls into: the
# FSDPModule methods (test_fsdp_api.py) and torch.distributed.pipelining's schedules
# (test_fsdp_pipeline.py; torch 2.15 changed how they end a step).
TORCH_SUBSET := tests/test_placement.py tests/test_placement_dist.py tests/test_fsdp_numerics.py \
	tests/test_patterns_engine.py tests/test_checkpoint.py tests/test_optim_api.py tests/test_torch_private.py \
	tests/test_fsdp_api.py tests/test_fsdp_pipeline.py
# an empty subset would run the whole suite, in a venv without the integration extras
CHECK_SUBSET = @test -n "$(strip $(TORCH_SUBSET))" || { echo "TORCH_SUBSET is empty"; exit 1; }

# torch 2.14.1: its wheel lies on local disk (a CUDA build; it runs on the CPU); only pytest and
# hypothesis come with it. Not in CI (2.15.0 is, below); kept for a check by hand.
VENV214 := .venv-torch214
STAMP214 := $(VENV214)/.installed-$(SUM)

$(STAMP214): pyproject.toml
	test -x $(VENV214)/bin/python || $(PY) -m venv $(VENV214)
	$(VENV214)/bin/pip install -q torch==2.14.1
	$(VENV214)/bin/pip install -q torch==2.14.1 'pytest>=8' 'hypothesis>=6' -e .
	rm -f $(VENV214)/.installed-* && touch $@

test-torch214: $(STAMP214)
	$(VENV214)/bin/python -c "import torch; assert torch.__version__.startswith('2.14.1'), torch.__version__"
	$(CHECK_SUBSET)
	$(VENV214)/bin/python -m pytest $(TORCH_SUBSET)

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
	$(CHECK_SUBSET)
	$(VENV215)/bin/python -m pytest $(TORCH_SUBSET)

# Today's Hugging Face releases: the integration tests (accelerate, Trainer, QLoRA through both,
# HF models under fully_shard) on transformers 5.25.0 and accelerate 1.16.0, in a venv of their
# own layered on .venv (a .pth file puts .venv's packages behind its own, so only the two
# releases and their new dependencies are installed). Not in CI: about 10 minutes beside
# `make test`'s 25 (docs/integrations.md).
VENVHF5 := .venv-hf5
HF5_TESTS := tests/test_integration_accelerate.py tests/test_fsdp_hf.py tests/test_quant_bnb4_hf.py

$(VENVHF5)/.installed-$(SUM): $(STAMP)
	test -x $(VENVHF5)/bin/python || $(BIN)/python -m venv --without-pip $(VENVHF5)
	$(BIN)/python -c "import site; print(site.getsitepackages()[0])" > \
		$$($(VENVHF5)/bin/python -c "import site; print(site.getsitepackages()[0])")/dot-venv.pth
	$(VENVHF5)/bin/python -m pip install -q $(TORCH) transformers==5.25.0 accelerate==1.16.0
	rm -f $(VENVHF5)/.installed-* && touch $@

test-hf5: $(VENVHF5)/.installed-$(SUM)
	PYTHONPATH=src $(VENVHF5)/bin/python -m pytest $(HF5_TESTS)

bench: $(STAMP_DEMO)
	$(BIN)/python -m ragged_fsdp bench

# the side-by-side bench against torch 2.15.0's FSDP2 (and FSDP1, DDP), short form
bench-torch215: $(STAMP215)
	$(VENV215)/bin/python -m ragged_fsdp bench --quick

plan: $(STAMP_DEMO)
	$(BIN)/python -m ragged_fsdp plan --model llama3-70b,gpt-oss-120b,deepseek-v3 --world 1024,8192 --granularity row,rows:128 --suggest

# On the lent GPU machine (its own python3 and torch 2.11, no venv, nothing installable):
# the CUDA tests and a W=1 CUDA bench against FSDP2. Meant to finish in under 5 minutes.
gpu-check:
	PYTHONPATH=src python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
	PYTHONPATH=src timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_fsdp_cuda.py
	mkdir -p $${OUT:-out} && PYTHONPATH=src timeout 240 python3 benchmarks/gpu.py --json $${OUT:-out}/gpu_bench.json
	PYTHONPATH=src timeout 180 python3 benchmarks/gpu_calibrate.py --out $${OUT:-out}/gpu_profile.json

clean:
	rm -rf $(VENV) $(VENV214) $(VENV215) $(VENVHF5) out build src/*.egg-info
