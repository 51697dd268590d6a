"""A run's start-up on the stand-in GPU, first run and cached, before and after (issue 47): passes, searches, seconds.

The stand-in GPU (:class:`blockpred.models.standin.StandInGpu`) sleeps as a
device at ``--rate`` input Mvox/s would, and while cuDNN's search is on
(``torch.backends.cudnn.benchmark``) its first pass at each new shape and
precision sleeps ``--search`` seconds more; an unsearched pass takes
``--gain`` longer.  On an H200 cremi2018's search took 17.5 s, 90 of its
passes (2026-11-27); the default search here, 2 s, is about 9 passes of the
block the defaults choose on the default volume: a search far cheaper than
the GPU's, which flatters the tree that searches more.  Each pass is a line
of its log, so the passes and searches are counted.

A tree before this change (``--tree NAME=DIR``) has no stand-in GPU and never
sets the flag on the CPU; its CUDA predictor turned the search on for every
pass.  Both trees load the stand-in from this tree through one shim module,
which for a tree named ``before*`` turns the flag on at import, as that
predictor did on CUDA before any pass.

Per tree and round: an empty cache, then runs of ``python -m blockpred run``
(a fresh process each, the user's whole command) until one says its choices
are cached (at most ``--runs``).  Reported: the first run and the cached run,
each with its whole command, its start-up (``started in``), its passes and
searches before its blocks, and its searches in all.

    python bench/bench_search_startup.py --tree before=/tmp/tree-main --tree after=. [--rounds 3] [--options ...]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHIM = '''
import importlib.util, os
if os.environ.get("STANDIN_SEARCH_ALWAYS"):
    import torch
    torch.backends.cudnn.benchmark = True  # what the tree's CUDA predictor set, for every pass
_spec = importlib.util.spec_from_file_location("_standin", {path!r})
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
gpu = _module.gpu
'''


def write_volume(path: Path, shape: tuple[int, int, int]) -> None:
    import zarr

    array = zarr.create_array(str(path), shape=shape, chunks=(64, 128, 128), dtype="uint8")
    array[:] = np.random.default_rng(0).integers(0, 255, shape, dtype=np.uint8)


def run(tree: Path, work: Path, log: Path, cache: Path, options: list[str], always: bool) -> dict:
    env = dict(os.environ, BLOCKPRED_CACHE_DIR=str(cache), PYTHONPATH=f"{work}:{tree}")
    env.pop("STANDIN_SEARCH_ALWAYS", None)
    if always:
        env["STANDIN_SEARCH_ALWAYS"] = "1"
    log.unlink(missing_ok=True)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "blockpred", "run", str(work / "in.zarr"), str(work / "out.zarr"),
                           "--model", "standin_shim:gpu", "--config", str(work / "gpu.yaml"), "--device", "cpu",
                           "--output-dtype", "uint8", "--overwrite", "--no-progress", *options],
                          capture_output=True, text=True, env=env, cwd=work)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{tree}: blockpred run failed: {done.stderr.strip()[-2000:]}")
    blocks = int(re.search(r"in (\d+) blocks", done.stdout).group(1))
    batch = int(re.search(r"batch (\d+)", done.stdout).group(1)) if re.search(r"batch (\d+)", done.stdout) else 1
    passes = [line.split()[3] for line in log.read_text().splitlines()]
    steady = -(-blocks // batch)
    return {"wall": wall, "started": float(re.search(r"started in ([\d.]+) s", done.stdout).group(1)),
            "before_blocks": len(passes) - steady, "searches_before": passes[:-steady].count("search"),
            "searches": passes.count("search"), "cached": "(cached)" in done.stdout}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, help="NAME=DIR, a blockpred tree")
    parser.add_argument("--shape", default="128,512,512")
    parser.add_argument("--rate", type=float, default=60.0, help="the stand-in's input Mvox/s")
    parser.add_argument("--search", type=float, default=2.0, help="seconds of a search")
    parser.add_argument("--gain", type=float, default=0.08)
    parser.add_argument("--runs", type=int, default=5, help="most runs until the choices are cached")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--options", default="", help="more options of every run, e.g. '--block 16,64,64'")
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    work = Path(tempfile.mkdtemp(prefix="search-startup-"))
    (work / "standin_shim.py").write_text(SHIM.format(path=str(here / "blockpred" / "models" / "standin.py")))
    log = work / "passes.log"
    (work / "gpu.yaml").write_text(f"model_kwargs: {{rate_mvox_per_s: {args.rate}, search_s: {args.search}, "
                                   f"gain: {args.gain}, log: {log}, receptive_radius: [8, 24, 24]}}\n")
    write_volume(work / "in.zarr", tuple(int(s) for s in args.shape.split(",")))
    trees = dict(spec.split("=", 1) for spec in args.tree)
    results: dict[str, dict[str, list[dict]]] = {name: {"first": [], "cached": []} for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            cache = work / f"cache-{name}"
            subprocess.run(["rm", "-rf", str(cache)], check=True)
            options = ["--precision", args.precision, *args.options.split()]
            first = run(Path(tree).resolve(), work, log, cache, options, name.startswith("before"))
            last = first
            for _ in range(args.runs - 1):
                last = run(Path(tree).resolve(), work, log, cache, options, name.startswith("before"))
                if last["cached"]:
                    break
            results[name]["first"].append(first)
            results[name]["cached"].append(last)
    print(f"stand-in GPU: {args.rate:g} input Mvox/s, search {args.search:g} s, unsearched passes "
          f"{args.gain:.0%} longer; volume {args.shape}, --precision {args.precision} {args.options}; medians of "
          f"{args.rounds}")
    print("| tree | run | whole command (s) | started in (s) | passes before the blocks | searches before "
          "the blocks | searches in all | cached |")
    print("|---|---|---|---|---|---|---|---|")
    for name in trees:
        for which in ("first", "cached"):
            rows = results[name][which]
            med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
            print(f"| {name} | {which} | {med('wall'):.2f} | {med('started'):.2f} | {med('before_blocks'):.0f} | "
                  f"{med('searches_before'):.0f} | {med('searches'):.0f} | {sum(r['cached'] for r in rows)}/{len(rows)} |")


if __name__ == "__main__":
    main()
