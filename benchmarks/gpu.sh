#!/usr/bin/env bash
# One command for a CUDA machine (sized for under 8 minutes on one H200):
#   (a) flex forward+backward against moba_reference, fp32 and bf16, block 128;
#   (b) the attention benchmark at GPU sizes, bf16, with a time budget; prints the table.
# Outputs go to ${OUT:-benchmarks/results}. Run from anywhere:  bash benchmarks/gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT_DIR="${OUT:-benchmarks/results}"
mkdir -p "$OUT_DIR"

# The first interpreter whose torch sees a GPU (a CPU-only .venv may sit in the checkout).
PY=""
for candidate in ${PYTHON:-} python3 python .venv/bin/python; do
  if command -v "$candidate" >/dev/null 2>&1 &&
     "$candidate" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    PY="$candidate"; break
  fi
done
if [ -z "$PY" ]; then echo "no python with CUDA torch found (set PYTHON=...)"; exit 2; fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv 2>/dev/null || true

echo "== (a) correctness: flex vs moba_reference (forward + backward) =="
timeout 150 "$PY" -m benchmarks.gpu_check --shapes 0 2 --dtypes bfloat16 float32 2>&1 | tee "$OUT_DIR/gpu_check.txt"
check_rc=${PIPESTATUS[0]}

echo "== (b) attention benchmark =="
# 512/3 at every S, plus 4096/12 at 131072; longest S first, so that a spent time budget
# (each new shape compiles flex kernels) skips the short rows, reported as skipped.
timeout 270 "$PY" -m benchmarks.attention --seq-lens 131072 32768 8192 --repeats 5 \
  --time-budget 210 --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/attention_cuda.log"
bench_rc=${PIPESTATUS[0]}

echo "== summary =="
[ -f "$OUT_DIR/attention_cuda.md" ] && cat "$OUT_DIR/attention_cuda.md"
echo "gpu_check exit $check_rc, attention exit $bench_rc; outputs in $OUT_DIR"
exit $(( check_rc != 0 || bench_rc != 0 ))
