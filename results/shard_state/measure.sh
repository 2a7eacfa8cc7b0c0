#!/bin/bash
# One exclusive slot: wide-mlp, 4 workers, --hosts 4: off / optimizer / gradients, then
# --memory-limit worker=L (L between gradients' and plain's job peaks) for plain and gradients.
set -u
cd /work/wt-zero
export TFDS_DATA_DIR=/work/shared/data/tfds
OUT=/tmp/zero-meas/runs
rm -rf $OUT; mkdir -p $OUT
echo "start $(date -u +%T) load: $(uptime)" > $OUT/notes.txt
run() {  # name, extra launch args..., -- train args
  local name=$1; shift
  local t0=$(date +%s)
  .venv/bin/python launch.py --strategy multiworker --workers 4 --hosts 4 "$@" > $OUT/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$(( $(date +%s) - t0 )) load: $(uptime)" >> $OUT/notes.txt
}
TA="--task wide-mlp --steps 12 --log-every 4 --startup-timeout 600"
for L in off optimizer gradients; do
  run $L -- $TA --shard-state $L --model-dir $OUT/$L
done
.venv/bin/python - > $OUT/limit.txt <<'PY'
import json, glob
def peaks(l):
    f = glob.glob(f'/tmp/zero-meas/runs/{l}/**/outcome.json', recursive=True)[0]
    p = json.load(open(f))['peak_rss_bytes']
    return [v for k, v in p.items() if k.startswith('worker')]
off, grad = max(peaks('off')), max(peaks('gradients'))
print(f"{(off + grad) // 2 // (1 << 20)}M" if grad < off else "none")
PY
LIM=$(cat $OUT/limit.txt)
echo "limit $LIM" >> $OUT/notes.txt
if [ "$LIM" != none ]; then
  run off-limited --memory-limit worker=$LIM -- $TA --shard-state off --model-dir $OUT/off-limited
  run gradients-limited --memory-limit worker=$LIM -- $TA --shard-state gradients --model-dir $OUT/gradients-limited
fi
echo "end $(date -u +%T)" >> $OUT/notes.txt
