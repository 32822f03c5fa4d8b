#!/usr/bin/env bash
# GPU check: install sift on a CUDA machine, run the GPU tests and the GPU benchmark suites,
# and pack the results. Run from the repository root:
#
#     OUT=/some/dir bash bench/gpu_check.sh      # -> $OUT/gpu_results.tgz and $OUT/summary.md
#
# The machine needs torch, triton and pytest already installed (nothing is downloaded).
# Results are packed after every step, so a run cut short still returns what it finished.
# The default first call (under 10 minutes) runs what has never run on a GPU first: the GPU
# tests, then the backward, quantized (4-bit bases) and memory suites, then the adamw suite, each
# suite cut at BENCH_TIMEOUT. The sector ceilings, the launch sweep and the heads suite take a
# second call:
#     SUITES="heads" EXTRAS="ceiling sweep" RUN_TESTS=0 bash bench/gpu_check.sh
set -uo pipefail
OUT=${OUT:-bench/results/gpu-run}
WORK=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SIFT_BENCH_DIR="$WORK" MAX_JOBS=${MAX_JOBS:-16}
SUITES=${SUITES-"backward quantized memory adamw"}  # also: heads (delta is a CPU benchmark)
RUN_TESTS=${RUN_TESTS:-1}
BENCH_ARGS=${BENCH_ARGS:-}               # e.g. --quick for a dry run of the plumbing
TEST_TIMEOUT=${TEST_TIMEOUT:-120}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-100}             # per suite: 4 suites, tests and install in 10 minutes
EXTRA_TIMEOUT=${EXTRA_TIMEOUT:-120}             # per extra script
EXTRAS=${EXTRAS-""}                      # ceiling (bench/gpu_sector_ceiling.py), sweep (bench/adamw_gpu_sweep.py)

pack() {
  {
    cat "$WORK/hardware.txt"
    echo
    echo "## GPU tests"
    tail -12 "$WORK/gpu_tests.txt" 2>/dev/null
    for suite in $SUITES; do [ -f "$WORK/bench_$suite.txt" ] && { echo; cat "$WORK/bench_$suite.txt"; }; done
    [ -f "$WORK/sector_ceiling.txt" ] && { echo; echo "## Random-sector ceilings"; cat "$WORK/sector_ceiling.txt"; }
    [ -f "$WORK/adamw_sweep.txt" ] && { echo; echo "## Launch sweep"; cat "$WORK/adamw_sweep.txt"; }
  } >"$OUT/summary.md"
  tar czf "$OUT/gpu_results.tgz" -C "$WORK" .
}

{
  echo "## Hardware"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton, platform; print('torch', torch.__version__, '| triton', triton.__version__, '| python', platform.python_version(), '|', torch.cuda.get_device_name())"
  lscpu | grep -m1 'Model name'
} 2>&1 | tee "$WORK/hardware.txt"

t0=$(date +%s)
python3 -m pip install --no-deps --no-build-isolation -e . >"$WORK/install.log" 2>&1 \
  || { echo "install failed:"; tail -30 "$WORK/install.log"; }
echo "install: $(( $(date +%s) - t0 )) s"
python3 -m sift.env >"$WORK/env.txt" 2>&1
pack

if [ "$RUN_TESTS" = 1 ]; then
  t0=$(date +%s)
  timeout "$TEST_TIMEOUT" python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests >"$WORK/gpu_tests.txt" 2>&1
  echo "gpu tests: exit $? in $(( $(date +%s) - t0 )) s"; tail -4 "$WORK/gpu_tests.txt"
  pack
fi

for suite in $SUITES; do
  t0=$(date +%s)
  timeout "$BENCH_TIMEOUT" python3 -m sift.bench "$suite" $BENCH_ARGS >"$WORK/bench_$suite.txt" 2>&1
  echo "bench $suite: exit $? in $(( $(date +%s) - t0 )) s"
  pack
done
if [[ " $EXTRAS " == *" ceiling "* ]]; then
  t0=$(date +%s)
  timeout "$EXTRA_TIMEOUT" python3 bench/gpu_sector_ceiling.py >"$WORK/sector_ceiling.txt" 2>&1
  echo "sector ceiling: exit $? in $(( $(date +%s) - t0 )) s"
  pack
fi
if [[ " $EXTRAS " == *" sweep "* ]]; then
  t0=$(date +%s)
  timeout "$EXTRA_TIMEOUT" python3 bench/adamw_gpu_sweep.py >"$WORK/adamw_sweep.txt" 2>&1
  echo "launch sweep: exit $? in $(( $(date +%s) - t0 )) s"
  pack
fi
grep -E "^\| (SparseAdamW|AdamW|sift|torch|fp64|Sparse|dense)" "$OUT/summary.md" | cut -c1-160 | head -60
