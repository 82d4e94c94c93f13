#!/usr/bin/env bash
# One prepared GPU check (one GPU, under 8 minutes): CUDA parity of every attention backend
# (kernels, packed documents and the TSP layer, bf16 + float32), the attention-kernel and
# packed-documents micro-benchmarks, the single-GPU emulation of rank 0 of the paper's 7B
# layer at D = 8 for S = 32K..128K, and TSP's engine alone (D = 1) against the plain model on one
# GPU: step times and a per-op profile.
# Writes $OUT_DIR/gpu_check.json (one document) plus the logs next to it.
#   usage: benchmarks/gpu_check.sh [OUT_DIR]     (default outputs/gpu_check)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT_DIR=${1:-outputs/gpu_check}
mkdir -p "$OUT_DIR"
export HF_HUB_OFFLINE=1

"$PY" -c "import torch; assert torch.cuda.is_available(), 'no GPU visible'; print(torch.cuda.get_device_name())" \
  || exit 1

# parity: kernels vs a dense reference, the TSP layer vs the HF modules (JUnit XML for the JSON)
timeout 240 "$PY" -m pytest -q tests/test_attention_kernels.py tests/test_cuda.py tests/test_pointwise.py \
  --junitxml "$OUT_DIR/parity.xml" 2>&1 | tee "$OUT_DIR/parity.log"
timeout 60 "$PY" -m pytest -q tests/test_packed.py -k cuda \
  --junitxml "$OUT_DIR/parity_packed.xml" 2>&1 | tee -a "$OUT_DIR/parity.log"

# kernels: TSP chunked attention (every backend) vs plain SDPA on the same tokens
for dt in bfloat16 float32; do
  timeout 60 "$PY" -m benchmarks.attention_kernels --device cuda --dtype "$dt" --seq-len 32768 \
    --heads 32 --kv-heads 8 --head-dim 128 --tsp 8 --json "$OUT_DIR/kernels_$dt.json" \
    2>&1 | tee -a "$OUT_DIR/kernels.log"
done

# packed documents (split at document starts, what the model runs) vs masked vs one stream
timeout 90 "$PY" -m benchmarks.packed --device cuda --dtype bfloat16 --seq-len 32768 --heads 32 \
  --kv-heads 8 --head-dim 128 --tsp 8 --doc-lens 256 1024 4096 --json "$OUT_DIR/packed_bf16.json" \
  2>&1 | tee -a "$OUT_DIR/kernels.log"

# memory and step time of one rank of the paper's 7B layer, D = 8, on the fake process group
for s in 32768 65536 131072; do
  timeout 90 "$PY" -m benchmarks.emulate --device cuda --dtype bfloat16 --devices 8 \
    --seq-len "$s" --json "$OUT_DIR/emulate_$s.json" 2>&1 | tee -a "$OUT_DIR/emulate.log"
done

# one process, no communication: the engine's own cost (recompute, chunked attention, matmuls)
D1_MODEL='{"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
  "num_key_value_heads": 8, "num_hidden_layers": 4, "vocab_size": 32000}'
timeout 150 "$PY" -m benchmarks.run --device cuda --devices 1 --seq-lens 8192 32768 \
  --layouts single tsp --dtype bfloat16 --model "$D1_MODEL" --steps 3 \
  --json "$OUT_DIR/step_d1.json" 2>&1 | tee "$OUT_DIR/step.log"
timeout 120 "$PY" -m benchmarks.profile_step --device cuda --dtype bfloat16 --seq-len 8192 \
  --layout single tsp --model "$D1_MODEL" --top 25 --json "$OUT_DIR/profile_d1.json" \
  2>&1 | tee -a "$OUT_DIR/step.log"

"$PY" - "$OUT_DIR" <<'PYEOF'
import glob, json, os, sys
import xml.etree.ElementTree as ET
out = sys.argv[1]
doc = {"parity": {}, "kernels": {}, "packed": {}, "emulate": {}, "step": {}, "profile": {}}
for xml in sorted(glob.glob(f"{out}/parity*.xml")):
    for case in ET.parse(xml).iter("testcase"):
        state = "failed" if case.find("failure") is not None or case.find("error") is not None \
            else "skipped" if case.find("skipped") is not None else "passed"
        doc["parity"][f"{case.get('classname')}::{case.get('name')}"] = state
for kind in ("kernels", "packed", "emulate", "step", "profile"):
    for f in sorted(glob.glob(f"{out}/{kind}_*.json")):
        doc[kind][os.path.basename(f)[len(kind) + 1 : -5]] = json.load(open(f))
json.dump(doc, open(f"{out}/gpu_check.json", "w"), indent=1)
failed = [k for k, v in doc["parity"].items() if v == "failed"]
print(f"wrote {out}/gpu_check.json: parity {len(doc['parity'])} cases, {len(failed)} failed")
PYEOF
