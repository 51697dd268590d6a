#!/usr/bin/env bash
# Issue 5's GPU figures, in two device calls of under 10 minutes each on one H200:
#   part 1: model-only cremi2018 at the seed's block, fp32/tf32/bf16/fp16, and the fast-path choices
#           (channels_last, torch.compile) at bf16;
#   part 2: end to end (`--pipeline`, GPU load sampled) at the seed's block and the auto-chosen one,
#           and unet32 with auto sizing;
#   part 3: the host-path ceiling on the machine's cores (issue 10's bench with the copy network on the GPU,
#           beside tensorstore's raw read+write of the same data), at two block shapes.
# Everything goes under $OUT (JSON, markdown tables, the log).  Not yet run: no GPU has been lent so far.
#
# From the repository root, through the device tool, with .whl in carry:
#   bash ../shared/tools/device-wheels.sh        # once, on the development machine
#   run(command="bash bench/gpu_fast_path.sh 1", carry=[".whl"], timeout_s=600)
#   run(command="bash bench/gpu_fast_path.sh 2", carry=[".whl"], timeout_s=600)
# then copy the tables of $OUT/*.md into bench/RESULTS.md with the date and these commands.
set -uo pipefail
part=${1:?usage: bash bench/gpu_fast_path.sh 1|2|3}
OUT=${OUT:-/tmp/blockpred-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export BLOCKPRED_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv > "$OUT/gpu-$part.csv" 2>&1
bench() {  # name, time limit in seconds, then blockpred bench options
  local name=$1 limit=$2; shift 2
  echo "== $name: blockpred bench $*" | tee -a "$OUT/log.txt"
  local start=$SECONDS
  timeout "$limit" python3 -m blockpred bench "$@" --json "$OUT/$name.json" --markdown "$OUT/$name.md" \
    >> "$OUT/log.txt" 2>&1 || echo "   exit $?" | tee -a "$OUT/log.txt"
  echo "   $((SECONDS - start)) s" | tee -a "$OUT/log.txt"
}
# The seed's block: 65x675x675 in, 55x575x575 out; on cremi2018's (1, 3, 3) grid: 55x576x576, halo (5, 50, 50).
SEED="--block 55,576,576 --halo 5,50,50"
if [ "$part" = 1 ]; then
  bench cremi-seed 240 --model cremi2018 $SEED --precision fp32,tf32,bf16,fp16 --iterations 10
  bench cremi-channels-last 90 --model cremi2018 $SEED --precision bf16 --memory-format channels_last --iterations 10
  bench cremi-compile 200 --model cremi2018 $SEED --precision bf16 --compile default --warmup 3 --iterations 10
elif [ "$part" = 3 ]; then
  for block in 64,256,256 128,512,512; do
    echo "== host-path-$block: bench/bench_host_path.py --device cuda" | tee -a "$OUT/log.txt"
    timeout 240 python3 bench/bench_host_path.py --device cuda --shape 512,1024,1024 --block "$block" --rounds 3 \
      --dir /tmp/blockpred-host --json "$OUT/host-path-$block.json" >> "$OUT/log.txt" 2>&1 \
      || echo "   exit $?" | tee -a "$OUT/log.txt"
  done
else
  bench cremi-seed-pipeline 150 --model cremi2018 $SEED --precision bf16 --pipeline --volume-shape 110,2304,2304
  bench cremi-auto-pipeline 220 --model cremi2018 --block auto --batch-size auto --precision bf16 \
    --pipeline --volume-shape 220,2304,2304
  bench unet32-auto 180 --model unet32 --block auto --batch-size auto --precision bf16,tf32 --pipeline \
    --volume-shape 512,1024,1024
fi
tail -n 40 "$OUT/log.txt"
