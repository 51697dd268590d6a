#!/usr/bin/env bash
# Start-up of `blockpred run --backend openvino` with a cold and then a warm conversion cache, for each checkout
# named (e.g. a worktree of an older commit and this one):
#   git worktree add /tmp/old 76a5398 && bash bench/bench_conversion_startup.sh /tmp/old "$PWD"
set -euo pipefail
PY=${PY:-python}
work=$(mktemp -d)
cd "$work"
$PY -c "
from pathlib import Path
from blockpred.io.synthetic import write_demo_volume
from blockpred.geometry import Coord
write_demo_volume(Path('d'), Coord((64, 512, 512)))"
for tree in "$@"; do
  cache=$(mktemp -d)
  for round in cold warm; do
    rm -rf out.zarr out.zarr.blockpred
    start=$(date +%s.%N)
    out=$(BLOCKPRED_CACHE_DIR=$cache PYTHONPATH=$tree $PY -m blockpred run d/volume.zarr/raw out.zarr --model tiny \
      --device cpu --backend openvino --block 64,256,256 --batch-size 1 --memory-format contiguous --no-progress --json)
    end=$(date +%s.%N)
    echo "$tree $round wall $(echo "$end - $start" | bc) $(echo "$out" | $PY -c 'import json, sys; d = json.load(sys.stdin); print("started_s", d["started_s"], "seconds", d["seconds"], "mvox/s", d["mvox_per_s"], "backend", d["backend"])')"
  done
  rm -rf "$cache"
done
rm -rf "$work"
