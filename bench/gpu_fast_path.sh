#!/usr/bin/env bash
# Issue 5's GPU figures in one device call (about 8 minutes on one H200): model-only and end-to-end
# Mvox/s of cremi2018 and unet32 at fp32/tf32/bf16/fp16, at the seed block and the auto-chosen one,
# plus the fast-path choices (channels_last, torch.compile, CUDA graphs).  Everything goes under $OUT.
#
# Run it through the device tool from the repository root, with .whl in carry:
#   bash ../shared/tools/device-wheels.sh        # once, on the development machine
#   run(command="bash bench/gpu_fast_path.sh", carry=[".whl"], timeout_s=600)
# then copy the tables of $OUT/*.md into bench/RESULTS.md with the date and this command.
set -uo pipefail
OUT=${OUT:-/tmp/blockpred-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export BLOCKPRED_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" 2>&1
bench() {  # name, then blockpred bench options
  local name=$1; shift
  echo "== $name: blockpred bench $*" | tee -a "$OUT/log.txt"
  timeout 170 python3 -m blockpred bench "$@" --json "$OUT/$name.json" --markdown "$OUT/$name.md" \
    >> "$OUT/log.txt" 2>&1 || echo "   exit $?" | tee -a "$OUT/log.txt"
}
# The seed's block: 65x675x675 in, 55x575x575 out (rounded to cremi2018's (1, 3, 3) grid by the bench).
SEED="--block 55,576,576 --halo 5,50,50"
bench cremi-seed --model cremi2018 $SEED --precision fp32,tf32,bf16,fp16 --iterations 5
bench cremi-auto --model cremi2018 --block auto --batch-size auto --precision bf16 \
  --pipeline --volume-shape 220,2304,2304
bench cremi-bf16-seed-pipeline --model cremi2018 $SEED --precision bf16 --pipeline --volume-shape 110,2304,2304
bench cremi-channels-last --model cremi2018 $SEED --precision bf16 --memory-format channels_last
bench cremi-compile --model cremi2018 $SEED --precision bf16 --compile max-autotune --warmup 3
bench unet32 --model unet32 --block auto --batch-size auto --precision fp32,tf32,bf16,fp16 --pipeline \
  --volume-shape 512,1024,1024
ls -la "$OUT" >> "$OUT/log.txt"
