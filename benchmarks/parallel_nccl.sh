#!/usr/bin/env bash
# Issue #10's GPU check: the bundled model on 2 GPUs (NCCL, tensor + expert parallel, the --mp 2
# split) against 1 GPU: greedy tokens identical, bits per byte equal within float tolerance, and
# decode tokens/s of each. One call on a 2-GPU machine (two H200s of one host):
#   bash benchmarks/parallel_nccl.sh          # writes JSON into $OUT (default /tmp/nccl-out)
# NVLink multicast stays off (the machine's rule; NCCL does not need it).
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/nccl-out}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
BPB_FILE=${BPB_FILE:-recipes/tiny/heldout/prose.jsonl}
MAX_NEW=${MAX_NEW:-96}
mkdir -p "$OUT"
$PY -c 'import torch; print("gpus", torch.cuda.device_count(), torch.__version__)' | tee "$OUT/env.txt"
nvidia-smi topo -m >> "$OUT/env.txt" 2>&1 || true
MP2=$(mktemp -d)/mp2
$PY -m dsv41_cli convert model/assets/dsv41-tiny "$MP2" --mp 2
PROMPTS=$(mktemp)
printf 'Add: 7 3 9 2 5\n\nAdd: 1 8 4 4 6 2\n\nAdd: 9 9 0 1\n\nAdd: 5 2 7 3 8 1 4\n' > "$PROMPTS"
GEN=(generate --input-file "$PROMPTS" --temperature 0 --max-new-tokens "$MAX_NEW" --device "$DEVICE" --json)
BPB=(bpb "$BPB_FILE" --baselines none --device "$DEVICE" --json)
$PY -m dsv41_cli "${GEN[@]}" > "$OUT/generate_1gpu.jsonl"
torchrun --nproc-per-node 2 -m dsv41_cli "${GEN[@]}" --model "$MP2" > "$OUT/generate_2gpu.jsonl"
$PY -m dsv41_cli "${BPB[@]}" > "$OUT/bpb_1gpu.json"
torchrun --nproc-per-node 2 -m dsv41_cli "${BPB[@]}" --model "$MP2" > "$OUT/bpb_2gpu.json"
$PY - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
one = [json.loads(l) for l in (out / "generate_1gpu.jsonl").read_text().splitlines() if l.strip()]
two = [json.loads(l) for l in (out / "generate_2gpu.jsonl").read_text().splitlines() if l.strip()]
b1 = json.loads((out / "bpb_1gpu.json").read_text())["models"][0]["overall_bpb"]
b2 = json.loads((out / "bpb_2gpu.json").read_text())["models"][0]["overall_bpb"]
report = {"greedy_tokens_identical": [a["output_ids"] == b["output_ids"] for a, b in zip(one, two)],
          "decode_tok_per_s_1gpu": [a["stats"]["decode_tokens_per_s"] for a in one],
          "decode_tok_per_s_2gpu": [b["stats"]["decode_tokens_per_s"] for b in two],
          "bpb_1gpu": b1, "bpb_2gpu": b2, "bpb_abs_diff": abs(b1 - b2)}
(out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
print(json.dumps(report, indent=1))
PY
# where a pair of greedy runs parts: the first differing token and its log-probability gap (CPU rescoring)
$PY benchmarks/greedy_divergence.py "$OUT/generate_1gpu.jsonl" "$OUT/generate_2gpu.jsonl" --prompts "$PROMPTS" \
    > "$OUT/divergence.jsonl" || true
