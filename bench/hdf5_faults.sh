#!/usr/bin/env bash
# An HDF5 output killed (SIGKILL) after N blocks are marked done, and one on a full disk, each run again: how many of
# the output's 64 blocks read as zeros afterwards (every one should hold its prediction). Runs the tree TREE (a
# checkout put first on PYTHONPATH), in DIR; the full disk is a 60 MB tmpfs (root only).
#
#   bash bench/hdf5_faults.sh TREE [DIR] [N]
set -uo pipefail
tree=$(realpath "$1"); dir=${2:-/tmp/blockpred-hdf5-faults}; marks=${3:-40}
mkdir -p "$dir" && cd "$dir" || exit 1
export PYTHONPATH=$tree BLOCKPRED_CACHE_DIR=$dir/cache-$(basename "$tree")
options=(--model tiny --device cpu --block 32,128,128 --no-progress)
[ -f k.h5 ] || python -c "import h5py, numpy as np; h5py.File('k.h5', 'w').create_dataset('raw', \
  data=(np.random.default_rng(1).random((128, 512, 512)) * 255).astype('uint8'), chunks=(32, 128, 128))"

zeros() {  # the blocks of the output $1 that read as all zeros
  python - "$1" <<'EOF'
import sys
from blockpred.geometry import Box
from blockpred.io import open_volume
volume = open_volume(sys.argv[1])
zero = sum(not volume.read(Box((z, y, x), (z + 32, y + 128, x + 128))).any()
           for z in range(0, 128, 32) for y in range(0, 512, 128) for x in range(0, 512, 128))
print(f"{zero} of 64 blocks read as zeros")
EOF
}
marked() { echo $(( $(cat "$1"/done/*.ids 2>/dev/null | wc -c) / 8 )); }

echo "== $tree: killed after $marks marks, then the same command"
rm -rf out.h5 out.h5.blockpred
python -m blockpred run k.h5:/raw out.h5:/pred "${options[@]}" >/dev/null 2>&1 & pid=$!
while kill -0 $pid 2>/dev/null; do
  if [ "$(marked out.h5.blockpred/pred)" -ge "$marks" ]; then kill -9 $pid; break; fi
  sleep 0.05
done
wait $pid 2>/dev/null
echo "killed with $(marked out.h5.blockpred/pred) blocks marked"
python -m blockpred run k.h5:/raw out.h5:/pred "${options[@]}" 2>/dev/null | grep predicted; echo "exit ${PIPESTATUS[0]}"
zeros out.h5:/pred

echo "== $tree: a 60 MB disk, then grown to 300 MB and the same command"
mkdir -p disk && (umount disk 2>/dev/null; mount -t tmpfs -o size=60m tmpfs disk) || exit 1
python -m blockpred run k.h5:/raw disk/out.h5:/pred "${options[@]}" >stdout.txt 2>stderr.txt
echo "exit $?; $(grep -c Traceback stderr.txt) tracebacks; $(marked disk/out.h5.blockpred/pred) blocks marked"
grep predicted stdout.txt; grep "^blockpred: error" stderr.txt | cut -c1-200
mount -o remount,size=300m disk
python -m blockpred run k.h5:/raw disk/out.h5:/pred "${options[@]}" 2>/dev/null | grep predicted; echo "exit ${PIPESTATUS[0]}"
zeros disk/out.h5:/pred
umount disk
