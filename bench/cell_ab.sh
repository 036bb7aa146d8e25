#!/usr/bin/env bash
# Time source variants of halstm against each other, one layer per shape,
# interleaved round by round (bench/gpu_ab.py). A variant is NAME (this
# tree as it is) or NAME:PATCH (a copy of this tree with PATCH, a unified
# diff, applied by patch -p1). Each variant compiles every cell and shape
# into /tmp/cell-ab/NAME (all at once, in parallel), then each cell and
# shape times every variant, each in a process of its own that runs its
# own copy's runtime (gpu_ab.py --runtime); the first variant is the base
# of the ratios.
# AB_ARGS: more arguments for bench/gpu_ab.py (--infer: the no_grad forward).
# PYTHON: the interpreter (default: the checkout's .venv where there is
# one, as the README sets it up, else python3).
#   [TARGET=host-cuda] [CELLS="lstm gru"] [SHAPES="I H B T;..."] [REPS=30] [AB_ARGS=...] \
#       bench/cell_ab.sh OUT.txt NAME[:PATCH] ...
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && py=$PWD/.venv/bin/python
out=$1; shift
target=${TARGET:-host-cuda}
shapes=${SHAPES:-"1024 1024 64 25;128 128 16 100;256 256 1 1000"}
IFS=';' read -ra rows <<< "$shapes"
root=/tmp/cell-ab
rm -rf "$root" && mkdir -p "$root"

pids=(); what=(); args=()
for v in "$@"; do
  name=${v%%:*}; patch=${v#*:}; [ "$patch" = "$v" ] && patch=""
  tree=$root/$name
  mkdir -p "$tree" && cp -r halstm schedules setup.py "$tree"/
  [ -e "$tree/halstm/schedules" ] || ln -s ../schedules "$tree/halstm/schedules"
  if [ -n "$patch" ]; then
    patch -s -p1 -d "$tree" < "$patch" || { echo "$patch does not apply" >&2; exit 1; }
  fi
  declare -A built=()
  for cell in ${CELLS:-lstm gru}; do
    for s in "${rows[@]}"; do
      read -r I H B T <<< "$s"
      # one library folder per cell, I and H (shapes of other B or T share it)
      [ -n "${built[$cell-$I-$H]:-}" ] && continue
      built[$cell-$I-$H]=1
      log=$tree/$cell-$I-$H.log
      # (from inside the copy: `python -c` puts the working directory
      # first on sys.path, ahead of PYTHONPATH)
      (cd "$tree" && HALSTM_CACHE=$tree/cache PYTHONPATH="$tree:${PYTHONPATH:-}" "$py" -c \
        "from halstm.cli import main; main()" compile --cell "$cell" -i "$I" -H "$H" \
        --target "$target" --out "$tree/$cell-$I-$H" > "$log" 2>&1) &
      pids+=($!); what+=("$name $cell H=$H (log $log)")
    done
  done
done
failed=0
for k in "${!pids[@]}"; do
  wait "${pids[$k]}" || { echo "compile failed: ${what[$k]}" >&2; failed=1; }
done
[ "$failed" = 0 ] || exit 1
# each variant's libraries carry the hash of the code they were built from
for v in "$@"; do
  name=${v%%:*}
  "$py" -c "import json, glob, sys; print(sys.argv[1], sorted({json.load(open(f))['halstm_code'][:12] for f in glob.glob(sys.argv[2] + '/*/*/manifest.json')}))" \
    "$name" "$root/$name" | tee -a "$out"
done
for cell in ${CELLS:-lstm gru}; do
  for s in "${rows[@]}"; do
    read -r I H B T <<< "$s"
    folders=(); runtimes=()
    for v in "$@"; do
      folders+=("${v%%:*}=$root/${v%%:*}/$cell-$I-$H")
      runtimes+=(--runtime "${v%%:*}=$root/${v%%:*}")
    done
    "$py" bench/gpu_ab.py --target "$target" --cell "$cell" --input-size "$I" \
      --hidden-size "$H" --batch "$B" --steps "$T" --reps "${REPS:-30}" ${AB_ARGS:-} \
      "${runtimes[@]}" "${folders[@]}" 2>&1 | tee -a "$out"
  done
done
