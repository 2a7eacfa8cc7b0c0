#!/bin/bash
# The multiworker x4 (and x1) unshaped CNN step: the code of the 2026-12-05 re-measure (d3fd1ce,
# /tmp/leftovers/old) against this branch, interleaved, one exclusive slot.
set -u
export TFDS_DATA_DIR=/work/shared/data/tfds
OUT=/tmp/leftovers/ab
PY=/work/wt-leftovers/.venv/bin/python
mkdir -p $OUT
log(){ echo "$(date -u +%FT%TZ) $(uptime) $*" | tee -a $OUT/load.txt; }
log start
for round in 1 2; do
  for code in old new; do
    if [ $code = old ]; then dir=/tmp/leftovers/old; else dir=/work/wt-leftovers; fi
    for acc in 4; do
      cd $dir
      PYTHONPATH=$dir $PY launch.py --strategy multiworker --workers 2 --timeout 300 -- \
        --model cnn --steps 100 --global-batch-size 128 --eval-every 0 --log-every 100 \
        --gradient-dtype float32 --gradient-accumulation-steps $acc \
        --model-dir $OUT/r$round-$code-acc$acc > $OUT/r$round-$code-acc$acc.log 2>&1
      log "end r$round-$code-acc$acc rc=$? $(python3 -c "import json;d=json.load(open('$OUT/r$round-$code-acc$acc/results.json'));print(round(d['examples_per_sec']), d.get('all_reduce_carried'))" 2>&1)"
    done
  done
done
