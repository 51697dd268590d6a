#!/bin/bash
# Usage: NETS="tiny unet12 cremi2018" bash bench/bench_backends.sh  (writes under /tmp/bk: a 64x512x512 synthetic
# EM volume, a 16x216x216 one for cremi2018, a scripted unet12)
# backends side by side through `blockpred run`, as a user types it.  cremi2018 (87.8 M parameters) names a block
# of 16x108x108 and a halo of 4,27,27: at its default block a CPU pass takes minutes.
set -u
mkdir -p /tmp/bk && cd /tmp/bk
B=${BLOCKPRED:-blockpred}
PY=${PYTHON:-python}
[ -d v.zarr ] || $PY -c "
from blockpred.io.synthetic import write_em_volume; from blockpred.geometry import Coord
write_em_volume('/tmp/bk/v.zarr', Coord((64, 512, 512)))"
[ -d small.zarr ] || $PY -c "
from blockpred.io.synthetic import write_em_volume; from blockpred.geometry import Coord
write_em_volume('/tmp/bk/small.zarr', Coord((16, 216, 216)))"
[ -f unet12.pt ] || $PY -c "
import torch; from blockpred.models.unet import UNet3d
torch.manual_seed(0); torch.jit.script(UNet3d(in_channels=1, out_channels=2, depth=3, initial_features=12).eval()).save('/tmp/bk/unet12.pt')"
for net in ${NETS:-tiny unet12}; do
  V=v.zarr
  case $net in
    tiny) M="--model tiny" ;;
    unet12) M="--model /tmp/bk/unet12.pt --halo 16,16,16" ;;
    cremi2018) M="--model cremi2018 --block 16,108,108 --halo 4,27,27"; V=small.zarr ;;
  esac
  for round in 1 2; do
    for backend in torch openvino auto; do
      cache=/tmp/bk/cache-$net-$backend; [ $round = 1 ] && rm -rf $cache
      start=$(date +%s.%N)
      BLOCKPRED_CACHE_DIR=$cache $B run $V out.zarr $M --backend $backend --overwrite --no-progress --json > /tmp/bk/$net-$backend-$round.json 2>/tmp/bk/$net-$backend-$round.err
      end=$(date +%s.%N)
      $PY -c "
import json,sys; d=json.load(open('/tmp/bk/$net-$backend-$round.json'))
print(f\"$net round $round --backend $backend: wall {$end-$start:.2f} s, started {d['started_s']:.2f} s, pipeline {d['seconds']:.2f} s, {d['mvox_per_s']:.3f} Mvox/s, ran {d['backend']}, peak {d['peak_rss_bytes']/2**30:.2f} GiB, chosen {d['chosen']}\")"
    done
  done
done
