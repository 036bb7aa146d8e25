#!/usr/bin/env bash
# On a GPU machine without a package registry (CONTRIBUTING.md, "Run the
# tests"): unpack the Halide bundle carried in .devcarry/, make halstm
# importable from this checkout, then run the GPU tests and `halstm bench`
# against cuDNN on the shared shapes. Output into $OUT (default
# /tmp/halstm-gpu-check): gpu_tests.log, bench.{txt,json,csv}.
#   bench/gpu_check.sh [tests] [bench]      (both when none is named)
#   SHAPES=small_128_b16,latency_256_b1 CELL=gru bench/gpu_check.sh bench
#   TARGET=host bench/gpu_check.sh bench     (the machine's CPU against torch's)
#   CELL=cifg_lstm PEERS=torch_eager bench/gpu_check.sh bench
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/halstm-gpu-check}
mkdir -p "$out"
if [ -f .devcarry/halide-py312.tar.xz ] && ! python3 -c "import halide" 2>/dev/null; then
    mkdir -p .site && tar xJf .devcarry/halide-py312.tar.xz -C .site
fi
# halstm.schedules is the top-level schedules/ folder (setup.py package_dir)
[ -e halstm/schedules ] || ln -s ../schedules halstm/schedules
export PYTHONPATH=$PWD/.site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export HALSTM_CACHE=${HALSTM_CACHE:-/tmp/halstm-gpu-cache}
python3 -c "import halide, torch; from halstm import cuda; print('halide', halide.__file__); \
print('torch', torch.__version__, torch.cuda.get_device_name(0)); print('halstm sees', cuda.driver().name)"
what=${*:-tests bench}
rc=0
if [[ " $what " == *" tests "* ]]; then
    HALSTM_TEST_CACHE=$HALSTM_CACHE python3 -m pytest -q -n 8 -p no:benchmark tests/gpu \
        > "$out/gpu_tests.log" 2>&1
    t=$?; rc=$((rc | t)); tail -3 "$out/gpu_tests.log"; echo "tests rc $t"
fi
if [[ " $what " == *" bench "* ]]; then
    shapes=${SHAPES:-charrnn_512x2,deepbench_1024,large_2048,small_128_b16,latency_256_b1}
    python3 -c "from halstm.cli import main; main()" bench --target "${TARGET:-host-cuda}" \
        --cell "${CELL:-lstm}" --shapes "$shapes" --peers "${PEERS:-torch}" --json "$out/bench.json" --csv "$out/bench.csv" \
        | tee "$out/bench.txt"
    rc=$((rc | PIPESTATUS[0]))
fi
exit $rc
