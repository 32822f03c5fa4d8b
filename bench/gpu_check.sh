#!/usr/bin/env bash
# GPU check: install sift on a CUDA machine, run the GPU tests and every benchmark suite,
# and pack the results. Run from the repository root:
#
#     OUT=/some/dir bash bench/gpu_check.sh        # results -> $OUT/gpu_results.tgz + summary.md
#
# The machine needs torch, triton and pytest already installed (nothing is downloaded).
set -uo pipefail
OUT=${OUT:-bench/results/gpu-run}
WORK=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SIFT_BENCH_DIR="$WORK" MAX_JOBS=${MAX_JOBS:-16}
SUITES=${SUITES:-"adamw heads delta memory"}

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
python3 -m sift.env 2>&1 | tee "$WORK/env.txt"

timeout 240 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests 2>&1 | tee "$WORK/gpu_tests.txt" | tail -25

for suite in $SUITES; do
  t0=$(date +%s)
  timeout 240 python3 -m sift.bench "$suite" >"$WORK/bench_$suite.txt" 2>&1
  echo "bench $suite: exit $? in $(( $(date +%s) - t0 )) s"
done

{
  cat "$WORK/hardware.txt"
  echo
  echo "## GPU tests"
  tail -5 "$WORK/gpu_tests.txt"
  for suite in $SUITES; do echo; cat "$WORK/bench_$suite.txt"; done
} >"$OUT/summary.md"
tar czf "$OUT/gpu_results.tgz" -C "$WORK" .
cat "$OUT/summary.md" | tail -120
