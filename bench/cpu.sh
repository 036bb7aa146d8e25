#!/usr/bin/env bash
# CPU runs of bench/RESULTS.md ("Which schedule is fastest on my CPU?"):
# the shared CPU shapes, the hand-written schedule against numpy and PyTorch
# (measured in the same run), then every schedule on the two smallest
# shapes. Writes bench/results/cpu_main.* and bench/results/cpu_schedules.*.
# Run on a quiet machine: these 2-core VMs are shared, and a second busy
# process doubles every figure (PyTorch's OpenMP threads suffer most).
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results
mkdir -p "$out"
halstm=.venv/bin/halstm
$halstm bench --shapes charrnn_512x2,deepbench_1024,small_128_b16,latency_256_b1 \
    --schedules cpu --peers numpy,torch \
    --csv "$out/cpu_main.csv" --json "$out/cpu_main.json" --plot "$out/cpu_main.png" \
    | tee "$out/cpu_main.txt"
$halstm bench --shapes small_128_b16,latency_256_b1 \
    --schedules naive,cpu,auto:Adams2019,auto:Li2018,auto:Mullapudi2016 --peers torch \
    --csv "$out/cpu_schedules.csv" --json "$out/cpu_schedules.json" \
    --plot "$out/cpu_schedules.png" | tee "$out/cpu_schedules.txt"
