#!/usr/bin/env bash
# Everything a GPU proves, in one call of the device tool (a lease is short and rare), within 8 minutes
# on a one-GPU machine:
#   run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=560)
# (the script keeps its own budget, GPU_SESSION_BUDGET_S=470 s, and skips with a line whatever would
# not fit; timeout_s leaves room above it for the tool's own start and the files coming back).
#
# Before the call, here (the wheels the CUDA image lacks; cp312 manylinux, as the device's Python 3.12):
#   rm -rf .whl && python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
#     -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 py-spy==0.4.3 \
#     typing-extensions==4.16.0 prometheus-client==0.26.0 pytest-xdist==3.8.0 execnet==2.1.2 pytest-timeout==2.4.0
# They are installed there with --no-index into /tmp/site, which goes first on PYTHONPATH (the caller's
# PYTHONPATH is kept behind it, and every test harness keeps it too). Assumed present in the image,
# checked first with a clear line each (step "imports"): torch with CUDA, pyyaml, rich, psutil,
# matplotlib (the jobs' plots), nvidia-ml-py (pynvml), pytest; typing-extensions (pydantic's).
# Nothing is fetched from the network there.
#
# Each step runs with its own timeout (capped by what is left of the budget), its output in
# $OUT/logs/<step>.log, its exit code and seconds in $OUT/summary.txt; a failing step never stops the
# script. Steps: the machine and the imports; NVML's recording; every job in jobs/ exactly as a new
# user types it (`python3 -m launcher jobs/X.yaml`, no override, --out under /tmp); `launch selftest
# --full --json`; `pytest -m gpu` over tests/gpu and the GPU benchmark tests (and the harness check);
# start-up against bare torchrun at world 1 and at 2 ranks sharing the GPU (benchmarks/startup.py);
# the matmul and DDP jobs against hand-written code (benchmarks/throughput.py, sized to fit); the
# selftest with 2 ranks sharing the GPU (its all-reduce and straggler parts); then BENCHMARKS.md's
# GPU section rendered from all of it (benchmarks/selftest_section.py) into
# $OUT/BENCHMARKS-gpu-section.md, for a session to copy in.
#
# Dry run (this script's own plumbing, on a CPU build): GPU_SESSION_DRY=1 bash benchmarks/gpu_session.sh
# (also taken when nvidia-smi finds no GPU): every step, on the CPU, with small sizes.
# A rerun of some steps in the same lease: GPU_SESSION_STEPS="pytest_gpu startup_world1" (names as in
# summary.txt) and a smaller GPU_SESSION_BUDGET_S. $OUT ends with at most 5 files (the device tool
# brings back 8): summary.txt, BENCHMARKS-gpu-section.md, the two selftest reports, and
# session.tar.gz with all of it, every step's log and JSON.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT/logs"
PY=${PYTHON:-python3}
T0=$(date +%s)
BUDGET_S=${GPU_SESSION_BUDGET_S:-470}
RESERVE_S=20  # kept for the rendering and the summary at the end
SUMMARY=$OUT/summary.txt
RUNS=$(mktemp -d /tmp/gpu-session-runs.XXXXXX)
# a rerun within the same lease: only the steps named here (the wheels, machine and imports always run)
ONLY=${GPU_SESSION_STEPS:-}
[ -n "$ONLY" ] && ONLY="wheels machine imports $ONLY"
MARK=gpu-session-$$-$RANDOM  # every step's processes carry GPU_SESSION_MARK=$MARK: leftovers are found by it, killed by pid
export PYTHONUNBUFFERED=1

DRY=${GPU_SESSION_DRY:-0}
if [ "$DRY" != 1 ] && ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  DRY=1
  echo "no GPU (nvidia-smi finds none): a dry run on the CPU, small sizes"
fi
{ printf '# gpu_session.sh %s, %s, dry=%s, budget %ss\n' "$(date -u '+%Y-%m-%d %H:%M:%S UTC')" "$(git log -1 --format=%h 2>/dev/null)" "$DRY" "$BUDGET_S"
  printf '%-24s %6s %8s %6s  %s\n' step rc seconds limit command; } > "$SUMMARY"

record() {  # record NAME RC SECONDS LIMIT TEXT
  printf '%-24s %6s %8s %6s  %s\n' "$1" "$2" "$3" "$4" "$5" >> "$SUMMARY"
  printf '[%4ss] %-24s rc=%s %ss\n' "$(( $(date +%s) - T0 ))" "$1" "$2" "$3"
}

sweep() {  # SIGKILL, by pid, whatever a step left behind (its processes carry the mark in their environment)
  local f pid left=()
  for f in /proc/[0-9]*/environ; do
    pid=${f#/proc/}; pid=${pid%/environ}
    [ "$pid" = "$$" ] && continue
    grep -qzx "GPU_SESSION_MARK=$MARK" "$f" 2>/dev/null && left+=("$pid")
  done
  if [ ${#left[@]} -gt 0 ]; then
    kill -9 "${left[@]}" 2>/dev/null
    echo "  (killed ${#left[@]} leftover process(es) of the step: ${left[*]})"
  fi
}

# step NAME LIMIT_S CMD...: run CMD (stdout to $STEP_STDOUT when set, else with stderr to the log)
step() {
  local name=$1 limit=$2 left rc t1 t2 secs
  shift 2
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then
    record "$name" skip 0 "$limit" "not chosen (GPU_SESSION_STEPS=$ONLY)"
    return 0
  fi
  left=$(( BUDGET_S - RESERVE_S - ($(date +%s) - T0) ))
  if [ "$left" -lt 15 ]; then
    record "$name" skip 0 "$limit" "not run: ${left}s left of the ${BUDGET_S}s budget"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "\$ $*" > "$OUT/logs/$name.log"
  t1=$(date +%s.%N)
  if [ -n "${STEP_STDOUT:-}" ]; then
    env GPU_SESSION_MARK="$MARK" timeout -k 10 "$limit" "$@" > "$STEP_STDOUT" 2>> "$OUT/logs/$name.log" < /dev/null
  else
    env GPU_SESSION_MARK="$MARK" timeout -k 10 "$limit" "$@" >> "$OUT/logs/$name.log" 2>&1 < /dev/null
  fi
  rc=$?
  t2=$(date +%s.%N)
  secs=$(awk -v a="$t1" -v b="$t2" 'BEGIN { printf "%.1f", b - a }')
  sweep >> "$OUT/logs/$name.log"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then rc="$rc:timeout"; fi
  record "$name" "$rc" "$secs" "$limit" "$(printf '%s ' "$@" | tr -s '\n' ' ')"
  return 0
}

# --- the packages: the wheels the image lacks, then a line for each thing the steps need ----------
SITE=${GPU_SESSION_SITE:-/tmp/site}
if ls .whl/*.whl >/dev/null 2>&1; then
  if "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    step wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH=$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}
    export PATH=$SITE/bin:$PATH
  else
    record wheels skip 0 0 "not installed: the wheels in .whl/ are cp312, this is $("$PY" -V 2>&1)"
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
  fi
else
  record wheels skip 0 0 "no .whl/ here (run the download line at the top of this script before the call, carry=[\".whl\"])"
  export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
fi

STEP_STDOUT=$OUT/machine.txt step machine 60 bash -c \
  'date -u; git log -1 --format=%H 2>/dev/null; nproc; free -g | head -2; nvidia-smi 2>&1 || echo "nvidia-smi: none";
   '"$PY"' -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count())"'

cat > "$RUNS/imports.py" <<'EOF'
import importlib, shutil, sys
dry = sys.argv[1] == "1"
need = {  # module: (why, required)
    "torch": ("the ranks", True), "yaml": ("job specs (pyyaml)", True), "pydantic": ("the spec model (wheel)", True),
    "rich": ("the console", True), "psutil": ("process tables", True), "matplotlib": ("the jobs' plots", True),
    "pynvml": ("GPU discovery and health (nvidia-ml-py)", not dry), "prometheus_client": ("the live /metrics endpoint (wheel)", True),
    "pytest": ("pytest -m gpu", True), "xdist": ("pytest -n (wheel pytest-xdist): without it the tests run one at a time", False),
    "pytest_timeout": ("the suite's per-test timeout (wheel pytest-timeout)", False),
}
missing = []
for mod, (why, required) in need.items():
    try:
        m = importlib.import_module(mod)
        print(f"ok       {mod:18s} {getattr(m, '__version__', '')} {getattr(m, '__file__', '')}")
    except Exception as exc:  # noqa: BLE001
        print(f"MISSING  {mod:18s} {why}: {type(exc).__name__}: {exc}")
        missing += [mod] if required else []
spy = shutil.which("py-spy")
print(f"{'ok' if spy else 'MISSING':8s} {'py-spy':18s} {spy or 'hang evidence without stacks (wheel py-spy)'}")
import torch
print(f"cuda: available={torch.cuda.is_available()} devices={torch.cuda.device_count()}")
if not dry and not torch.cuda.is_available():
    missing.append("cuda")
if missing:
    print("MISSING (required): " + ", ".join(missing) + ": add them to the wheel line at the top of benchmarks/gpu_session.sh")
sys.exit(1 if missing else 0)
EOF
STEP_STDOUT=$OUT/imports.txt step imports 60 "$PY" "$RUNS/imports.py" "$DRY"

if [ "$DRY" = 1 ]; then DEV=cpu; else DEV=cuda; fi
STEP_STDOUT=$OUT/nvml_record.json step nvml_record 30 "$PY" -m launcher.hardware.nvml --record

# --- every job in jobs/, as a new user types it ------------------------------------------------
dry_sets() {  # small sizes on the CPU (the dry run proves the plumbing, not the jobs)
  case $1 in
    cpu_vs_gpu) echo "--set params.sizes=[16,256] --set params.work_gflop=0.05 --set params.trials=2" ;;
    ddp_train) echo "--set params.n_train=1024 --set params.n_test=256 --set params.hidden=32 --set params.batch_size=128 --set params.epochs=2" ;;
    matmul_scaling) echo "--set params.sizes=[128,256] --set params.trials=2" ;;
    sync_logging) echo "--set params.steps=50 --set params.repeats=1" ;;
    transfer) echo "--set params.sizes_mb=[1] --set params.repeats=2" ;;
  esac
}
for spec in jobs/*.yaml; do
  job=$(basename "$spec" .yaml)
  extra=()
  [ "$DRY" = 1 ] && read -r -a extra <<< "$(dry_sets "$job")"
  step "job_$job" 100 "$PY" -m launcher "$spec" --out "$RUNS/jobs" "${extra[@]}"
  result=$(ls -d "$RUNS/jobs/$job"/*/ 2>/dev/null | tail -n 1)
  [ -n "$result" ] && [ -f "$result/result.json" ] && cp "$result/result.json" "$OUT/logs/job-$job.result.json"
done

# --- the selftest, the GPU tests --------------------------------------------------------------
if [ "$DRY" = 1 ]; then LEVEL=--quick; else LEVEL=--full; fi
STEP_STDOUT=$OUT/selftest.json step selftest 180 "$PY" -m launcher selftest "$LEVEL" --json --out "$RUNS/selftest"

XDIST=()
if [ "$DRY" != 1 ] && "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n 4); fi
# -rP: each passed test's output too (the in-place tests print their recovery's figures)
step pytest_gpu 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rfEsP "${XDIST[@]}" --junitxml="$OUT/pytest_gpu.xml" \
  tests/gpu tests/benchmarks/test_recorder_gpu.py
grep -h "recovery in place on the GPU" "$OUT/logs/pytest_gpu.log" 2>/dev/null | sort -u > "$OUT/figures.txt"
step pytest_harness 90 "$PY" -m pytest -q -p no:cacheprovider -rfEs tests/gpu/test_harness_env.py

# --- the GPU benchmarks, sized to fit ---------------------------------------------------------
# start-up against bare torchrun: world 1, and 2 ranks sharing the GPU (benchmarks/startup.py: --pairs N
# interleaved launch/torchrun pairs; where this startup.py has no --pairs yet, --reps N, said in the summary)
PAIRS=--pairs
if ! "$PY" benchmarks/startup.py --help 2>/dev/null | grep -q -- '--pairs'; then
  PAIRS=--reps
  record startup_flags note 0 0 "benchmarks/startup.py has no --pairs: ran with --reps instead"
fi
if [ "$DRY" = 1 ]; then
  step startup_world1 150 "$PY" benchmarks/startup.py --device cpu "$PAIRS" 1 --no-ray --out "$OUT/startup-world1.json"
  step startup_shared 150 "$PY" benchmarks/startup.py --device cpu --world 2 "$PAIRS" 1 --no-ray --out "$OUT/startup-shared.json"
  step throughput 200 "$PY" benchmarks/throughput.py --smoke --device cpu --out "$OUT/throughput.json"
else
  step startup_world1 100 "$PY" benchmarks/startup.py --device cuda "$PAIRS" 3 --no-ray --out "$OUT/startup-world1.json"
  step startup_shared 100 "$PY" benchmarks/startup.py --device cuda --ranks-per-gpu 2 "$PAIRS" 3 --no-ray --out "$OUT/startup-shared.json"
  # the matmul (bf16, n=4096 and 8192) and DDP (world 1) jobs against hand-written code: ~35 s a repetition
  step throughput 150 "$PY" benchmarks/throughput.py --device cuda --reps 2 --budget-s 90 --out "$OUT/throughput.json"
fi

# the selftest's matmul against a hand loop right after it, same products, same process (within 3%?)
if [ "$DRY" = 1 ]; then
  STEP_STDOUT=$OUT/hand_vs_selftest.json step hand_vs_selftest 60 "$PY" benchmarks/hand_matmul.py --sizes 512 --dtype float32 --device cpu \
    --against-selftest --warmup-s 0.5 --trial-s 0.1 --trials 10
else
  STEP_STDOUT=$OUT/hand_vs_selftest.json step hand_vs_selftest 60 "$PY" benchmarks/hand_matmul.py --sizes 8192 --dtype bfloat16 --device cuda \
    --against-selftest
fi

# the selftest's multi-rank parts on one GPU: node all-reduce (gloo over CUDA tensors), the straggler on CUDA events
STEP_STDOUT=$OUT/selftest-shared.json step selftest_shared 120 "$PY" -m launcher selftest --quick --json --out "$RUNS/selftest" \
  --set resources.gpus_per_node=1 --set resources.ranks_per_gpu=2

# --- BENCHMARKS.md's GPU section, from what this run recorded ----------------------------------
RESERVE_S=0
reports=()
for f in "$OUT/selftest.json" "$OUT/selftest-shared.json"; do [ -s "$f" ] && reports+=("$f"); done
STEP_STDOUT=$OUT/BENCHMARKS-gpu-section.md step render 30 "$PY" benchmarks/selftest_section.py --session "$OUT" "${reports[@]}"

rm -rf "$RUNS"
total=$(( $(date +%s) - T0 ))
failed=$(awk 'NR > 2 && $2 != "0" && $2 != "skip" && $2 != "note" { print $1 }' "$SUMMARY" | tr '\n' ' ')
skipped=$(awk 'NR > 2 && $2 == "skip" { print $1 }' "$SUMMARY" | tr '\n' ' ')
printf '# total %ss; failed: %s; skipped: %s\n' "$total" "${failed:-none}" "${skipped:-none}" >> "$SUMMARY"
[ -s "$OUT/figures.txt" ] && sed 's/^/# figure: /' "$OUT/figures.txt" >> "$SUMMARY"  # after the step table: what the tests printed
echo
cat "$SUMMARY"
for name in $failed; do
  log="$OUT/logs/$name.log"
  [ -f "$log" ] && { echo; echo "--- tail of $log"; tail -n 25 "$log"; }
done
# the device tool brings back 8 files at most: everything goes into one archive, and the few a
# session reads first stay beside it (tar xzf session.tar.gz for the logs and every JSON)
tar czf "$RUNS.tar.gz" -C "$OUT" . && mv "$RUNS.tar.gz" "$OUT/session.tar.gz"
find "$OUT" -mindepth 1 -maxdepth 1 ! -name session.tar.gz ! -name summary.txt ! -name BENCHMARKS-gpu-section.md \
  ! -name selftest.json ! -name selftest-shared.json -exec rm -rf {} +
[ -z "$failed" ]
