#!/bin/bash
# One measurement batch of the scaling curves: every cell one launch.py job on
# simulated hosts with their own CPU budget (--host-cpus), copied into runs/.
#   results/scale/measure.sh BATCH CELL...      CELL = kind:workers:ps:cpus:rate:task:steps[:tag]
# rate "none" = unshaped links; a tag names a cell measured again (NAME-TAG). Run it under the machine's exclusive lock.
# SCALE_OUT=DIR writes runs/ and runs.log under DIR instead (results/scale/ctr).
set -u
here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../.." && pwd)
py="$repo/.venv/bin/python"; batch=$1; shift
out=${SCALE_OUT:-$here}; mkdir -p "$out"
export TFDS_DATA_DIR=${TFDS_DATA_DIR:-/work/shared/data/tfds}
work=$(mktemp -d /tmp/scale-XXXX)
echo "batch $batch start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/runs.log"
for cell in "$@"; do
  IFS=: read -r kind n ps cpus rate task steps tag <<< "$cell"
  per=64; [ "$task" = ctr ] && per=256
  # ps: every worker runs whole steps of the global batch, so the per-worker batch is it.
  gb=$((per * n)); [ "$kind" = ps ] && gb=$per
  hosts=$n; extra=(); [ "$kind" != multiworker ] && { hosts=$((n + 1)); extra=(--ps "$ps"); }
  [ "$rate" != none ] && extra+=(--link-rate "$rate")
  k=(); [ "$kind" = ps-sync ] && k=(--replicas-to-aggregate "$n")
  name="$task-$kind-${n}w-${ps}ps-c$cpus-$rate${tag:+-$tag}"
  dir="$work/$name"
  t0=$(date +%s)
  timeout 600 "$py" "$repo/launch.py" --strategy "$kind" --workers "$n" "${extra[@]}" \
      --hosts "$hosts" --host-cpus "$cpus" --timeout 500 -- \
      --task "$task" --global-batch-size "$gb" --steps "$steps" \
      --steps-per-execution 10 --eval-every 0 --log-every 50 "${k[@]}" --seed 42 \
      --model-dir "$dir" > "$work/$name.log" 2>&1
  rc=$?
  mkdir -p "$out/runs/$name"
  cp "$dir/results.json" "$out/runs/$name/" 2>/dev/null
  cp "$dir/launch/outcome.json" "$out/runs/$name/" 2>/dev/null
  tail -5 "$work/$name.log" > "$out/runs/$name/tail.log"
  echo "$batch $name rc=$rc $(( $(date +%s) - t0 ))s load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/runs.log"
done
rm -rf "$work"
echo "batch $batch end $(date -u +%T)" >> "$out/runs.log"
