#!/bin/bash
# One exclusive slot: wide-mlp, 4 workers, --hosts 4, 12 steps: off / optimizer / gradients /
# weights one after another (each worker's peak RssAnon sampled beside the runs' own records),
# then --memory-limit worker=L for plain and gradients, L between their RssAnon peaks.
set -u
cd "$(dirname "$0")/../.."  # the checkout (run from a copy of it, PYTHONPATH at the copy)
PY=.venv/bin/python
export TFDS_DATA_DIR=/work/shared/data/tfds
OUT=/tmp/zero3-meas/runs
rm -rf $OUT; mkdir -p $OUT
echo "start $(date -u +%T) load: $(uptime)" > $OUT/notes.txt
run() {  # name, extra launch args..., -- train args
  local name=$1; shift
  local t0=$(date +%s)
  rm -f $OUT/$name.stop
  $PY - "$OUT/$name.d" $OUT/$name.anon.json $OUT/$name.stop <<'SAMPLER' &
"""Sample every process whose command line holds MARK: the highest RssAnon of each, in MiB,
written to OUT when the file STOP appears."""
import os, sys, time, json
mark, out, stop = sys.argv[1], sys.argv[2], sys.argv[3]
peak = {}
while not os.path.exists(stop):
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            if mark not in cmd or "train.py" not in cmd and "tfdist" not in cmd:
                continue
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("RssAnon:"):
                    kb = int(line.split()[1])
                    key = f"{pid} {cmd[-60:]}"
                    peak[key] = max(peak.get(key, 0), kb // 1024)
        except OSError:
            pass
    time.sleep(0.2)
json.dump(peak, open(out, "w"), indent=1)
SAMPLER
  local sampler=$!
  $PY launch.py --strategy multiworker --workers 4 --hosts 4 "$@" > $OUT/$name.log 2>&1
  local rc=$?
  touch $OUT/$name.stop; wait $sampler
  echo "$name rc=$rc seconds=$(( $(date +%s) - t0 )) load: $(uptime)" >> $OUT/notes.txt
}
# The weights level's one-process tests first (seconds): a failure leaves it out of the slot.
LEVELS="off optimizer gradients weights"
timeout 300 $PY -m pytest -q -x -p no:cacheprovider tests/training/test_zero3.py \
  > $OUT/unit.log 2>&1 || LEVELS="off optimizer gradients"
echo "unit rc=$? levels: $LEVELS" >> $OUT/notes.txt
TA="--task wide-mlp --steps 12 --log-every 4 --startup-timeout 600"
for L in $LEVELS; do
  run $L -- $TA --shard-state $L --model-dir "$OUT/$L.d"
done
$PY - > $OUT/limit.txt <<'PY'
import json
def top(l):
    return max(json.load(open(f'/tmp/zero3-meas/runs/{l}.anon.json')).values())
off, grad = top('off'), top('gradients')
print(f"{(off + grad) // 2}M" if grad < off else "none")
PY
LIM=$(cat $OUT/limit.txt)
echo "limit $LIM" >> $OUT/notes.txt
if [ "$LIM" != none ]; then
  run off-limited --memory-limit worker=$LIM -- $TA --shard-state off --model-dir "$OUT/off-limited.d"
  run gradients-limited --memory-limit worker=$LIM -- $TA --shard-state gradients --model-dir "$OUT/gradients-limited.d"
fi
echo "end $(date -u +%T)" >> $OUT/notes.txt
# The weights level, once its one-process tests pass (as run: its release fixed while the slot ran).
if timeout 120 $PY -m pytest -q -x -p no:cacheprovider tests/training/test_zero3.py > $OUT/unit2.log 2>&1; then
  run weights -- $TA --shard-state weights --model-dir "$OUT/weights.d"
fi
echo "end2 $(date -u +%T)" >> $OUT/notes.txt
