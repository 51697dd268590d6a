#!/bin/bash
# Usage: bash bench/bench_backends.sh  (writes under /tmp/bk: a 64x512x512 synthetic EM volume, a scripted unet12)
# backends side by side through `blockpred run`, as a user types it
set -u
mkdir -p /tmp/bk && cd /tmp/bk
B=${BLOCKPRED:-blockpred}
PY=${PYTHON:-python}
[ -d v.zarr ] || $PY -c "
from blockpred.io.synthetic import write_em_volume; from blockpred.geometry import Coord
write_em_volume('/tmp/bk/v.zarr', Coord((64, 512, 512)))"
[ -f unet12.pt ] || $PY -c "
import torch; from blockpred.models.unet import UNet3d
torch.manual_seed(0); torch.jit.script(UNet3d(in_channels=1, out_channels=2, depth=3, initial_features=12).eval()).save('/tmp/bk/unet12.pt')"
for net in tiny unet12; do
  if [ $net = tiny ]; then M="--model tiny"; else M="--model /tmp/bk/unet12.pt --halo 16,16,16"; fi
  for round in 1 2; do
    for backend in torch openvino auto; do
      cache=/tmp/bk/cache-$net-$backend; [ $round = 1 ] && rm -rf $cache
      start=$(date +%s.%N)
      BLOCKPRED_CACHE_DIR=$cache $B run v.zarr out.zarr $M --backend $backend --overwrite --no-progress --json > /tmp/bk/$net-$backend-$round.json 2>/tmp/bk/$net-$backend-$round.err
      end=$(date +%s.%N)
      $PY -c "
import json,sys; d=json.load(open('/tmp/bk/$net-$backend-$round.json'))
print(f\"$net round $round --backend $backend: wall {$end-$start:.2f} s, started {d['started_s']:.2f} s, pipeline {d['seconds']:.2f} s, {d['mvox_per_s']:.3f} Mvox/s, ran {d['backend']}, chosen {d['chosen']}\")"
    done
  done
done
