#!/usr/bin/env bash
# Time schedule variants of one kind against each other on a GPU machine, in
# one run: each variant is a set of environment variables read by
# schedules/cuda.py, compiled into a cache folder of its own, and every
# shape's forward is checked against the numpy reference before it is timed.
#   bench/gpu_variants.sh OUT.txt "name:VAR=v,VAR=v" ... [-- probe options]
# Shapes: I H B T, one per line on stdin, or the default five below.
set -uo pipefail
out=$1; shift
variants=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do variants+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
shapes=${SHAPES:-"1024 1024 64 25;2048 2048 32 50;512 512 64 100;128 128 16 100;256 256 1 1000"}
IFS=';' read -ra rows <<< "$shapes"
# Compile every (variant, shape) first, in parallel (CPU only), so that the
# timed runs below find their libraries cached.
for v in "${variants[@]}"; do
  name=${v%%:*}; envs=${v#*:}; [ "$envs" = "$v" ] && envs=""
  for s in "${rows[@]}"; do
    read -r I H B T <<< "$s"
    env ${envs//,/ } HALSTM_CACHE=/tmp/halstm-variant-$name python3 -c \
      "import halstm; halstm.LSTM($I, $H, target='host-cuda').compile()" > /dev/null 2>&1 &
  done
done
wait
for v in "${variants[@]}"; do
  name=${v%%:*}; envs=${v#*:}; [ "$envs" = "$v" ] && envs=""
  for s in "${rows[@]}"; do
    read -r I H B T <<< "$s"
    echo "== $name ($envs) I=$I H=$H B=$B T=$T" | tee -a "$out"
    env ${envs//,/ } HALSTM_CACHE=/tmp/halstm-variant-$name python3 bench/gpu_probe.py \
      --input-size "$I" --hidden-size "$H" --batch "$B" --steps "$T" --check "$@" 2>&1 \
      | tail -4 | tee -a "$out"
  done
done
