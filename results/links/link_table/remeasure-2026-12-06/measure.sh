#!/bin/bash
# One exclusive slot: the accumulation rows and the x1 exposed compute (link_table, round 1),
# the traced bucketed overlap (one bucket vs 256 KiB, plain step, steps 150:155), then the
# multiworker rows again (round 2): interleaved, one run.
set -u
cd /work/wt-leftovers
export TFDS_DATA_DIR=/work/shared/data/tfds
OUT=/tmp/leftovers/meas
PY=.venv/bin/python
mkdir -p $OUT
log(){ echo "$(date -u +%FT%TZ) $(uptime) $*" | tee -a $OUT/load.txt; }
log start
$PY -m tfdist.cli.tools.link_table --out $OUT/table1 --steps 100 --run-timeout 300 \
  --rows multiworker-w2-f32-acc1,multiworker-w2-f32-acc4,ps-w2-f32-acc1,ps-w2-f32-acc4
log "end table1 rc=$?"
for b in 64m 256k; do
  $PY launch.py --strategy multiworker --workers 2 --timeout 300 --hosts 2 --link-rate 100mbit -- \
    --model cnn --steps 160 --global-batch-size 128 --eval-every 0 --log-every 160 \
    --all-reduce-bucket $b --carry-all-reduce off --profile-steps 150:155 \
    --model-dir $OUT/trace-$b > $OUT/trace-$b.log 2>&1
  log "end trace-$b rc=$?"
done
$PY -m tfdist.cli.tools.link_table --out $OUT/table2 --steps 100 --run-timeout 300 \
  --rows multiworker-w2-f32-acc1,multiworker-w2-f32-acc4
log "end table2 rc=$?"
