#!/usr/bin/env bash
# Time variants against each other on a GPU machine, in one run. A variant is
# a name and environment settings ("name:VAR=v VAR=v"; "name:" for none),
# e.g. HALSTM_CUDA_GRAPHS=0, or a knob added to a schedule for the
# experiment. Each variant compiles into a cache folder of its own (all of
# them first, in parallel), then each shape's forward is checked against the
# numpy reference and timed by bench/gpu_probe.py.
#   [SHAPES="I H B T;I H B T"] bench/gpu_variants.sh OUT.txt VARIANT ... [-- probe options]
# SHAPES defaults to the five below (the shared benchmark shapes' layers).
# COMPILE_ONLY=1: compile, time nothing (so that several scripts can compile
# at once and then time one after another).
set -uo pipefail
out=$1; shift
variants=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do variants+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
shapes=${SHAPES:-"1024 1024 64 25;2048 2048 32 50;512 512 64 100;128 128 16 100;256 256 1 1000"}
IFS=';' read -ra rows <<< "$shapes"

# run VARIANT CMD...: CMD with the variant's settings and cache folder
run() {
  local name=${1%%:*} envs=${1#*:}; shift
  [ "$envs" = "$name" ] && envs=""
  env $envs HALSTM_CACHE=/tmp/halstm-variant-$name "$@"
}

pids=(); what=()
for v in "${variants[@]}"; do
  for s in "${rows[@]}"; do
    read -r I H B T <<< "$s"
    log=/tmp/halstm-variant-${v%%:*}-$H.log
    run "$v" python3 -c "import halstm; halstm.LSTM($I, $H, target='host-cuda').compile()" \
      > "$log" 2>&1 &
    pids+=($!); what+=("$v H=$H (log $log)")
  done
done
failed=0
for k in "${!pids[@]}"; do
  wait "${pids[$k]}" || { echo "compile failed: ${what[$k]}" >&2; failed=1; }
done
[ "$failed" = 0 ] || exit 1
[ -n "${COMPILE_ONLY:-}" ] && exit 0     # (compile now, time in a later call)
for v in "${variants[@]}"; do
  for s in "${rows[@]}"; do
    read -r I H B T <<< "$s"
    echo "== $v I=$I H=$H B=$B T=$T" | tee -a "$out"
    run "$v" python3 bench/gpu_probe.py --input-size "$I" --hidden-size "$H" --batch "$B" \
      --steps "$T" --check "$@" 2>&1 | tail -4 | tee -a "$out"
  done
done
