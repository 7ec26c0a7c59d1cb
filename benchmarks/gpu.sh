#!/usr/bin/env bash
# What flexmoba needs to learn from its first GPU, in at most TOTAL_S (480 s) on one H200.
#
#   part         what                                                        cap   H200 estimate
#   device       the GPU, CUDA and torch                                      30 s    5 s
#   oracle       every timed method vs the fp32 oracle, fwd+bwd: bf16 at     150 s  100 s (9 flex
#                512/3 and 128/8, fp32 at 512/3, documents at S 3000; the                 compiles)
#                union mask's compact tables vs its full width at S 64K
#   determinism  two flex fwd+bwd runs bitwise equal in deterministic mode    60 s   25 s
#   flash        flex Triton vs BACKEND=FLASH fwd+bwd, if flash_attn.cute     90 s   40 s (5 s without)
#   timing       the methods that passed the oracle: regrouped/union flex,   240 s  240 s (fills its
#                gather, SDPA causal; 128K, 32K, 8K (the first two fit,                   budget)
#                8K rows may be skipped), 512/3 and 128/8, bf16, fwd and fwd+bwd
#   mfu          MFU of a 100-step `flexmoba fit` of configs/moba.yaml       150 s   80 s
#                                                         expected total ~430-470 s
#   scaling      only when named (--parts scaling, TOTAL_S=600): the        600 s  resumes
#                continued-scaling study of SmolLM2 at 8K, budgets 125-1000 steps, scored on the GPU;
#                started again it goes on where it stopped (needs make pretrained)
#
# Each part is its own process under its own `timeout` and ends with one verdict line
# (PASS/FAIL/SKIP, or TIMEOUT from here), so a failing part never hides another. A part gets
# its cap or what is left of TOTAL_S after keeping the later parts' minimum, whichever is less.
# gpu.md is rewritten after every part, so a run cut short still leaves its verdicts.
#
#   bash benchmarks/gpu.sh                         # GPU: benchmarks/results/gpu.md, raw outputs in gpu/
#   bash benchmarks/gpu.sh --device cpu            # dry run at tiny sizes into a temporary OUT
#                                                  # (caps x3, TOTAL_S 900: a CPU dry run times nothing)
#   bash benchmarks/gpu.sh --parts oracle,timing   # rerun some parts (the others' verdicts are kept)
#
# Environment: OUT (output folder), PYTHON (interpreter), TOTAL_S, TIMEOUT_<PART> (a part's cap).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

ALL_PARTS=(device oracle determinism flash timing mfu scaling)
DEFAULT_PARTS=(device oracle determinism flash timing mfu)  # scaling runs only when named
declare -A CAP=([device]=30 [oracle]=150 [determinism]=60 [flash]=90 [timing]=240 [mfu]=150 [scaling]=600)
declare -A MINIMUM=([device]=5 [oracle]=60 [determinism]=20 [flash]=20 [timing]=60 [mfu]=60 [scaling]=60)

DEVICE="${DEVICE:-cuda}"
PARTS="$(IFS=,; echo "${DEFAULT_PARTS[*]}")"
while (( $# )); do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --device=*) DEVICE="${1#*=}"; shift ;;
    --parts) PARTS="$2"; shift 2 ;;
    --parts=*) PARTS="${1#*=}"; shift ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
for part in ${PARTS//,/ }; do
  [[ -n "${CAP[$part]:-}" ]] || { echo "gpu.sh: no part named $part (parts: ${ALL_PARTS[*]})" >&2; exit 2; }
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu.sh: --device is cuda or cpu, not $DEVICE" >&2; exit 2 ;; esac

if [[ "$DEVICE" == cpu ]]; then
  OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/flexmoba-gpu-dry-run.XXXXXX")}"
  mkdir -p "$OUT"
  if [[ "$(realpath "$OUT")" == "$(realpath -m benchmarks/results)" ]]; then
    echo "gpu.sh: a dry run never writes the committed results: set OUT to another folder" >&2; exit 2
  fi
  # Generous: the dry run's times mean nothing, and a CPU shared with other jobs can be 3x slower.
  TOTAL_S="${TOTAL_S:-900}"
  for part in "${ALL_PARTS[@]}"; do CAP[$part]=$(( 3 * CAP[$part] )); done
else
  OUT="${OUT:-benchmarks/results}"
  TOTAL_S="${TOTAL_S:-480}"
fi
RAW="$OUT/gpu"
mkdir -p "$RAW"

# The interpreter: PYTHON if set, else the first whose torch sees a GPU (or, dry, has torch).
if [[ "$DEVICE" == cuda ]]; then
  PROBE="import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
else
  PROBE="import torch"
fi
PY=""
for candidate in ${PYTHON:-python3 python .venv/bin/python}; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "$PROBE" 2>/dev/null; then PY="$candidate"; break; fi
done
if [[ -z "$PY" ]]; then echo "gpu.sh: no python with torch for $DEVICE found (set PYTHON=...)" >&2; exit 2; fi

# Sizes: the real ones on the GPU; on CPU one tiny static shape for every part (each new shape
# compiles new flex kernels, 7-25 s each on CPU), fp32, forward only where flex has no backward.
if [[ "$DEVICE" == cuda ]]; then
  HEADS=(--heads 8 --kv_heads 2 --head_dim 128)
  ORACLE_ARGS=("${HEADS[@]}" --seq_len 4096 --configs 512:3 128:8 --dtypes bfloat16 float32 --docs_seq_len 3000)
  DETERMINISM_ARGS=("${HEADS[@]}" --seq_len 4096 --config 512:3 --dtype bfloat16)
  FLASH_ARGS=("${HEADS[@]}" --seq_len 8192 --config 512:3)
  TIMING_ARGS=("${HEADS[@]}" --seq_lens 131072 32768 8192 --configs 512:3 128:8 --dtype bfloat16 --repeats 5)
  FIT_ARGS=(--configs configs/moba.yaml --steps 100)
  SCALING_ARGS=(--out "$RAW/scaling")
else
  HEADS=(--heads 2 --kv_heads 1 --head_dim 16)
  ORACLE_ARGS=("${HEADS[@]}" --seq_len 256 --configs 64:2 --dtypes float32 --docs_seq_len 256)
  DETERMINISM_ARGS=("${HEADS[@]}" --seq_len 256 --config 64:2 --dtype float32)
  FLASH_ARGS=("${HEADS[@]}" --seq_len 256 --config 64:2)
  TIMING_ARGS=("${HEADS[@]}" --seq_lens 256 --configs 64:2 --dtype float32 --repeats 2)
  FIT_ARGS=(--configs configs/moba.yaml configs/tiny.yaml --steps 2)
  SCALING_ARGS=(--out "$RAW/scaling" --seq_len 256 --budgets 3 6 --eval_seq_len 512 --eval_documents 2)
fi

# cmd_<part> TIMEOUT: the part's command, into CMD.
cmd_device() { CMD=("$PY" -m benchmarks.device --device "$DEVICE"); }
cmd_oracle() { CMD=("$PY" -m benchmarks.gpu_check --device "$DEVICE" "${ORACLE_ARGS[@]}" --out "$RAW/checks.json"); }
cmd_determinism() { CMD=("$PY" -m benchmarks.gpu_determinism --device "$DEVICE" "${DETERMINISM_ARGS[@]}"); }
cmd_flash() { CMD=("$PY" -m benchmarks.gpu_flash --device "$DEVICE" "${FLASH_ARGS[@]}" --out "$RAW/flash.md"); }
cmd_timing() {  # rows that would start in the last 45 s are skipped, so the part ends in time
  local budget=$(( $1 > 90 ? $1 - 45 : $1 / 2 ))
  CMD=("$PY" -m benchmarks.gpu_timing --checks "$RAW/checks.json" --device "$DEVICE" "${TIMING_ARGS[@]}"
       --methods sdpa_causal moba_flex moba_flex_union moba_gather --time_budget "$budget" --out "$RAW")
}
cmd_mfu() { CMD=("$PY" -m benchmarks.gpu_mfu --device "$DEVICE" "${FIT_ARGS[@]}" --out "$RAW"); }
cmd_scaling() { CMD=("$PY" -m benchmarks.gpu_scaling --device "$DEVICE" "${SCALING_ARGS[@]}"); }

selected() { [[ ",$PARTS," == *",$1,"* ]]; }

# record PART STATUS SECONDS WHY
record() {
  printf '%s\t%s\t%s\n' "$2" "$3" "$4" > "$RAW/$1.verdict"
  echo ">> $1: $2 (${3}s) $4"
}

write_report() {
  local device_line="(device part did not pass)" title
  if [[ -f "$RAW/device.verdict" ]] && [[ "$(cut -f1 "$RAW/device.verdict")" == PASS ]]; then
    device_line="$(cut -f3- "$RAW/device.verdict")"
  fi
  if [[ "$DEVICE" == cuda ]]; then title="# flexmoba on $device_line"
  else title="# flexmoba GPU script, dry run on $device_line"; fi
  {
    echo "$title"
    echo
    echo "Written by \`bash benchmarks/gpu.sh --device $DEVICE\` with $("$PY" --version 2>&1) on $(date -u '+%Y-%m-%d %H:%M UTC');"
    echo "each part's full output is in \`gpu/<part>.log\`."
    echo
    echo "## Verdicts"
    echo
    echo "| part | verdict | seconds | why |"
    echo "|---|---|---|---|"
    for part in "${ALL_PARTS[@]}"; do
      if [[ -f "$RAW/$part.verdict" ]]; then
        IFS=$'\t' read -r status seconds why < "$RAW/$part.verdict"
        echo "| $part | $status | $seconds | ${why//|/\\|} |"
      else
        echo "| $part | not run | | |"
      fi
    done
    section "Oracle check (fp32 oracle, before timing)" "$RAW/checks.md"
    section "Triton vs FLASH" "$RAW/flash.md"
    section "Attention timing" "$RAW/attention_$DEVICE.md"
  } > "$OUT/gpu.md"
}

section() {  # section TITLE FILE: the file's contents, if the part wrote it
  [[ -f "$2" ]] || return 0
  printf '\n## %s\n\n' "$1"
  cat "$2"
}

run_part() {
  local name=$1
  selected "$name" || return 0
  local cap_var="TIMEOUT_${name^^}" reserve=0 later=0 part
  local cap=${!cap_var:-${CAP[$name]}}
  for part in "${ALL_PARTS[@]}"; do
    if (( later )) && selected "$part"; then reserve=$(( reserve + MINIMUM[$part] )); fi
    [[ "$part" == "$name" ]] && later=1
  done
  local left=$(( TOTAL_S - (SECONDS - START) - reserve ))
  local t=$(( cap < left ? cap : left ))
  echo
  if (( left < 5 )); then
    echo "== $name =="
    record "$name" SKIP 0 "no time left of TOTAL_S=${TOTAL_S}s"; write_report; return
  fi
  echo "== $name (timeout ${t}s) =="
  "cmd_$name" "$t"
  local began=$SECONDS
  timeout -k 10 "$t" "${CMD[@]}" 2>&1 | tee "$RAW/$name.log"
  local rc=${PIPESTATUS[0]} seconds=$(( SECONDS - began ))
  local line status why
  line="$(grep -a "^VERDICT $name " "$RAW/$name.log" | tail -n 1)"
  if (( rc == 124 || (rc == 137 && seconds >= t) )); then  # 137: still alive 10 s after the TERM
    status=TIMEOUT; why="killed after ${t}s (cap ${cap}s)"
  elif [[ -z "$line" ]]; then
    status=FAIL
    why="exit $rc without a verdict; last line: $(grep -av '^[[:space:]]*$' "$RAW/$name.log" | tail -n 1 | cut -c1-300)"
  else
    line="${line#VERDICT "$name" }"
    status="${line%% *}"; why="${line#* }"
    if (( rc != 0 )) && [[ "$status" != FAIL ]]; then why="exit $rc after its verdict $status: $why"; status=FAIL; fi
  fi
  record "$name" "$status" "$seconds" "$why"
  write_report
}

START=$SECONDS
echo "gpu.sh: device $DEVICE, python $PY, parts $PARTS, at most ${TOTAL_S}s, output in $OUT"
# A selected part's old outputs go first: the timing part must never read a previous run's checks.
declare -A OUTPUTS=([oracle]="checks.json checks.md" [flash]=flash.md [mfu]=fit_metrics.csv
                    [timing]="attention_$DEVICE.md attention_$DEVICE.json")
for part in "${ALL_PARTS[@]}"; do
  if selected "$part"; then
    for file in $part.verdict $part.log ${OUTPUTS[$part]:-}; do rm -f "$RAW/$file"; done
  fi
done
for part in "${ALL_PARTS[@]}"; do
  run_part "$part"
done
write_report

echo
echo "== summary ($(( SECONDS - START ))s; $OUT/gpu.md) =="
failed=0
for part in "${ALL_PARTS[@]}"; do
  [[ -f "$RAW/$part.verdict" ]] || continue
  IFS=$'\t' read -r status seconds why < "$RAW/$part.verdict"
  if selected "$part"; then
    [[ "$status" == FAIL || "$status" == TIMEOUT ]] && failed=1
  else
    why="(kept from an earlier run) $why"
  fi
  printf '%-12s %-8s %5ss  %s\n' "$part" "$status" "$seconds" "$why"
done
exit "$failed"
