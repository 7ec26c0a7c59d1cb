#!/usr/bin/env bash
# One command for a CUDA machine (sized for under 8 minutes on one H200):
#   (a) flex forward+backward against moba_reference, fp32 and bf16, block 128;
#   (b) regrouped flex, union flex, gather and SDPA causal at 8K-128K, 512/3 and 128/8, bf16,
#       forward and forward+backward, with FLOP ideal and achieved fraction;
#   (c) 1M tokens forward at 4096/12 where memory allows;
# and writes benchmarks/results/gpu.md naming the GPU.
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

echo "== (b) attention: regrouped flex vs union flex vs gather vs SDPA (flash) causal, bf16 =="
# 512/3 (the paper) and 128/8 (FlashMoBA's setting) at each S, forward and forward+backward;
# longest S first, so that a spent time budget (each new shape compiles flex kernels) skips
# the short rows, reported as skipped.
timeout 300 "$PY" -m benchmarks.attention --seq_lens 131072 32768 8192 --configs 512:3 128:8 \
  --methods sdpa_causal moba_flex moba_flex_union moba_gather --repeats 5 \
  --time_budget 240 --out "$OUT_DIR/gpu_train" 2>&1 | tee "$OUT_DIR/attention_cuda.log"
bench_rc=${PIPESTATUS[0]}

echo "== (c) 1M tokens, forward, 4096/12 (the paper's figure), where memory allows =="
timeout 100 "$PY" -m benchmarks.attention --seq_lens 1048576 --configs 4096:12 --heads 1 \
  --methods sdpa_causal moba_flex --no_backward --repeats 2 --out "$OUT_DIR/gpu_1m" 2>&1 | tee -a "$OUT_DIR/attention_cuda.log"
long_rc=${PIPESTATUS[0]}

{
  echo "# flexmoba on $("$PY" -c 'import torch; print(torch.cuda.get_device_name())')"
  echo
  echo "torch $("$PY" -c 'import torch; print(torch.__version__)'), written by benchmarks/gpu.sh on $(date -u +%Y-%m-%d)."
  echo
  echo "## Correctness (flex vs moba_reference)"; echo; echo '```'; cat "$OUT_DIR/gpu_check.txt"; echo '```'
  echo; echo "## 8K-128K, forward and forward+backward"; echo
  cat "$OUT_DIR/gpu_train/attention_cuda.md" 2>/dev/null || echo "(no table: see attention_cuda.log)"
  echo; echo "## 1M tokens, forward"; echo
  cat "$OUT_DIR/gpu_1m/attention_cuda.md" 2>/dev/null || echo "(no table: see attention_cuda.log)"
} > "$OUT_DIR/gpu.md"

echo "== summary =="
cat "$OUT_DIR/gpu.md"
echo "gpu_check exit $check_rc, attention exit $bench_rc, 1M exit $long_rc; written to $OUT_DIR/gpu.md"
exit $(( check_rc != 0 || bench_rc != 0 ))
