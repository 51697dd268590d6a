#!/usr/bin/env bash
# Issue 9's GPU figures and checks, in a few device calls of under 10 minutes each on one H100 or H200.
# Parts (any number, run in the order given):
#   env       the GPU, driver, torch and the two ceilings (device copy GB/s, bf16 matrix TFLOP/s)
#   gputests  `pytest -m gpu`
#   suite     the whole suite (SUITE_LIMIT seconds, 500 by default), short tracebacks and the slowest tests
#   model     model-only cremi2018 at the seed's block, fp32/tf32/bf16/fp16, and channels_last at bf16
#   compile   torch.compile (default) at bf16 at the seed's block
#   pseed     end to end (`bench --pipeline`, GPU load sampled) at the seed's block
#   pauto     the same at the auto-chosen block and batch, and unet32 with auto sizing
#   local     `blockpred run` on one GPU: the default (in this process) against --workers 1 (dask), and that
#             again with MALLOC_ARENA_MAX=1; same volume and block
#   host      the host-path ceiling on the machine's cores (the copy network on the GPU, beside
#             tensorstore's raw read+write of the same data), at two block shapes
# Everything goes under $OUT (JSON, markdown tables, the log).
#
# From the repository root, through the device tool, with .whl in carry:
#   bash ../shared/tools/device-wheels.sh ome-zarr-models==1.7 ...   # once, on the development machine
#   run(command="bash bench/gpu_fast_path.sh env gputests model", carry=[".whl"], timeout_s=600)
# then copy the tables of $OUT/*.md into bench/RESULTS.md with the date and these commands.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: bash bench/gpu_fast_path.sh env|gputests|suite|model|compile|pseed|pauto|local|host ..." >&2; exit 2; }
OUT=${OUT:-/tmp/blockpred-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export BLOCKPRED_CACHE_DIR=$OUT/cache PYTHONUNBUFFERED=1
log() { echo "$*" | tee -a "$OUT/log.txt"; }
bench() {  # name, time limit in seconds, then blockpred bench options
  local name=$1 limit=$2; shift 2
  log "== $name: blockpred bench $*"
  local start=$SECONDS
  timeout "$limit" python3 -m blockpred bench "$@" --json "$OUT/$name.json" --markdown "$OUT/$name.md" \
    >> "$OUT/log.txt" 2>&1 || log "   exit $?"
  log "   $((SECONDS - start)) s"
}
# The seed's block: 65x675x675 in, 55x575x575 out; on cremi2018's (1, 27, 27) downsampling grid: 55x594x594, halo (5, 50, 50).
SEED="--block 55,594,594 --halo 5,50,50"
for part in "$@"; do
  case $part in
  env)
    # the GPU, driver, torch, what is installed and the two ceilings: the campaign's own step
    OUT=$OUT timeout 120 python3 bench/gpu_campaign.py --parts env --budget 100 > /dev/null 2>&1
    ;;
  gputests)
    log "== pytest -m gpu"
    timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests > "$OUT/pytest-gpu.txt" 2>&1
    log "   exit $?: $(tail -n 1 "$OUT/pytest-gpu.txt")"
    ;;
  suite)
    log "== pytest (whole suite)"
    timeout "${SUITE_LIMIT:-500}" python3 -m pytest -q --tb=short --durations=15 -p no:cacheprovider tests > "$OUT/pytest-all.txt" 2>&1
    log "   exit $?: $(tail -n 1 "$OUT/pytest-all.txt")"
    ;;
  model)
    bench cremi-seed 200 --model cremi2018 $SEED --precision fp32,tf32,bf16,fp16 --iterations 10
    bench cremi-channels-last 90 --model cremi2018 $SEED --precision bf16,fp16 --memory-format channels_last \
      --iterations 10
    bench unet32-model 90 --model unet32 --block auto --batch-size auto --precision bf16 --volume-shape 512,1024,1024 \
      --iterations 10
    ;;
  compile)
    bench cremi-compile 240 --model cremi2018 $SEED --precision bf16 --compile default --warmup 3 --iterations 10
    ;;
  pseed)
    bench cremi-seed-pipeline 150 --model cremi2018 $SEED --precision bf16 --pipeline --volume-shape 110,2304,2304
    ;;
  pauto)
    bench cremi-auto-pipeline 220 --model cremi2018 --block auto --batch-size auto --precision bf16 \
      --pipeline --volume-shape 220,2304,2304
    bench unet32-auto 260 --model unet32 --block auto --batch-size auto --precision bf16 --pipeline \
      --volume-shape 512,1024,1024
    ;;
  local)
    timeout 120 python3 - <<'EOF' >> "$OUT/log.txt" 2>&1
import numpy as np, zarr
z = zarr.create_array("/tmp/bp-in.zarr", shape=(220, 2304, 2304), chunks=(64, 256, 256), dtype="uint8", overwrite=True)
rng = np.random.default_rng(0)
for k in range(0, 220, 55): z[k:k + 55] = rng.integers(0, 255, (min(55, 220 - k), 2304, 2304), dtype=np.uint8)
EOF
    # The default (in this process, one GPU) against one dask GPU worker (its pipeline kept across tasks),
    # and the same worker with glibc's arenas limited to one (CPU workers get MALLOC_ARENA_MAX=1).
    # "auto": the default precision (bf16 after the first block's check against fp32, see blockpred/precision.py).
    for mode in "auto" "" "--workers 1" "arena1 --workers 1"; do
      arena="" precision="--precision bf16"
      case "$mode" in arena1*) arena="MALLOC_ARENA_MAX=1"; mode="${mode#arena1 }" ;; auto) precision="" mode="" ;; esac
      log "== blockpred run cremi2018 ${precision:-precision auto} $SEED $mode $arena"
      start=$SECONDS
      env $arena timeout ${LOCAL_LIMIT:-200} python3 -m blockpred run /tmp/bp-in.zarr /tmp/bp-out.zarr --model cremi2018 $SEED \
        $precision --device cuda $mode --overwrite >> "$OUT/log.txt" 2>&1 || log "   exit $?"
      log "   $((SECONDS - start)) s"
    done
    ;;
  host)
    for block in ${HOST_BLOCKS:-64,256,256 128,512,512}; do
      log "== host-path-$block: bench/bench_host_path.py --device cuda"
      timeout ${HOST_LIMIT:-240} python3 bench/bench_host_path.py --device cuda --shape 512,1024,1024 --block "$block" --rounds 3 \
        --dir /tmp/blockpred-host --json "$OUT/host-path-$block.json" >> "$OUT/log.txt" 2>&1 \
        || log "   exit $?"
    done
    ;;
  *) log "unknown part $part" ;;
  esac
done
tail -n 60 "$OUT/log.txt"
