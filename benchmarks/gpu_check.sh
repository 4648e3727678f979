#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine (CuPy and torch, no Paddle): the
# kernel tests and the record writer's fuzz, the record bench, then compute-sanitizer's
# memcheck, racecheck, initcheck and synccheck over the writer's paths. Every part runs
# even when an earlier one fails; logs and bench_record.json go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
# spectrio without installing it (its Paddle dependency is not there): the folders
# that the GPU path imports, laid out as the installed package.
SHIM=$(mktemp -d)
mkdir -p "$SHIM/spectrio"
cp -r spectrio_root/. "$SHIM/spectrio/"
for d in core cuda_kernels models; do cp -r "$d" "$SHIM/spectrio/$d"; done
export PYTHONPATH=$SHIM PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import cupy, torch, numpy; print('cupy', cupy.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__)"

echo "== tests"
timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider --noconftest -c /dev/null \
  --rootdir . tests/test_cuda_kernels.py tests/test_record_writer.py tests/test_step_record.py \
  >"$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -n 25 "$OUT/tests.log"

echo "== bench"
timeout "${BENCH_S:-200}" python3 benchmarks/bench_record.py --json "$OUT/bench_record.json" \
  >/dev/null 2>"$OUT/bench.log"
echo "bench rc=$?"; cat "$OUT/bench.log"

for tool in memcheck racecheck initcheck synccheck; do
  echo "== compute-sanitizer $tool"
  BENCH_RECORD_NO_TORCH=1 timeout "${SAN_S:-90}" compute-sanitizer --tool "$tool" \
    --error-exitcode 9 python3 benchmarks/bench_record.py --sanitize >"$OUT/san_$tool.log" 2>&1
  echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|error" "$OUT/san_$tool.log" | tail -n 4
done

# Where a sanitizer points into step_record, its SASS (CuPy keeps the cubins it built).
for f in "$HOME"/.cupy/kernel_cache/*.cubin; do
  if cuobjdump -sass "$f" 2>/dev/null | grep -q "Function : step_record"; then
    cuobjdump -sass "$f" >"$OUT/step_record.sass"
  fi
done
