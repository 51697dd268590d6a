"""What a user feels: the whole ``blockpred run`` command at defaults against its peers.

For each volume size and each network, on the same synthetic EM-like uint8
zarr volume, the same network weights and the same halo:

* ``blockpred run`` as a user types it: ``python -m blockpred run RAW OUT
  --model M [--halo H] --overwrite --no-progress``, a subprocess, timed from
  start to exit (imports, model load, dry run, measuring, pipeline, exit), with
  no block, batch, memory format or device named: the measured defaults
  (:mod:`blockpred.tuning.defaults`) choose.  Timed once on an empty cache (the
  **first run**, which pays for measuring; its cache is then kept) and in every
  round after it (**cached**: what every later run costs).  The configuration
  the command chose (its ``chosen:`` line) is printed;
* ``blockpred.predict`` as a notebook user calls the Python API, timed inside
  one process of its own after its imports (``bench/predict_api.py``): the
  counterpart of the peers' in-process times, with no interpreter start and no
  import, but the model load, the volume's statistics, the dry run and any
  measuring in every call.  Its first call has an empty cache of its own (the
  first run), the calls after it keep it (cached);
* the peers, each timed two ways (their code: ``bench/peers.py``):

  - **in-process**, on the network object built once, after an untimed
    warm-up forward pass: the peer's steady state, paying no interpreter
    start, no import and no model load (blockpred's times include all of these);
  - **as a script** (``python bench/peers.py PEER NETWORK ...``, a subprocess,
    timed from start to exit as ``blockpred run`` is): what a user of the peer
    runs: imports torch and the peer, builds or loads the network, reads,
    predicts, writes a zarr array with blockpred's output chunks and codecs.
    ``--no-scripts`` leaves this out;

  ``torch-em predict_with_halo_pipelined`` (and ``predict_with_halo`` with
  ``--all-peers``): block 64^3 (the block a user of those tools picks), the
  same halo per side, the zarr array read lazily, the output written to zarr.
  ``MONAI sliding_window_inference`` with its defaults (overlap 0.25, blend
  ``constant``), ``roi_size`` = block + 2 x halo, ``sw_batch_size`` 1, timed
  from reading the zarr volume into memory to the result in memory (it needs
  the whole volume and the whole output there); as a script it then writes
  the result.

Every tool sees the same input values (uint8 -> float32 x 1/255, blockpred's
``auto`` normalisation).  Rounds alternate the tools; the table shows medians
(seconds of wall time) and the best peer's time against blockpred's (cached
and first run), like against like: the peers in-process against
``blockpred.predict`` in-process, the peers' scripts against ``blockpred run``
(and, as before, the peers in-process against ``blockpred run``).  Max |diff| against blockpred over
the interior (the halo away from every face): blockpred's chosen block
differs from the peers' 64^3, so outputs agree to float rounding where the halo
covers the network's receptive field (``tiny``) and differ near block edges
where it does not (``unet12``: depth 3, the halo 16 covers less than its field).

Networks: ``tiny`` (the preset: 4 features, depth 1, halo 10) and ``unet12``
(a user's TorchScript file: blockpred's UNet3d with 12 initial features, depth
3, 1 -> 2 channels, sigmoid, scripted and saved with ``torch.jit.script``; halo 16);
and the TorchScript files of networks nobody here wrote (``tests/scripted.py``, halo 16):
``loop-list`` (skips in a Python list), ``monai-basicunet``, ``monai-unet``, ``torch-em-unet3d``.
The first run's ``time:`` line (start-up, and the stages summed) is printed with it.

Sizes: ``--sizes 64,256,256x3,128,704,704x1`` = 64x256x256 (4.2 Mvox) in 3
rounds and 128x704x704 (63 Mvox) in 1.

Peers' installs: ``pip install -e ".[peers]"`` (monai; 1.6.x needs only torch>=2.8 and numpy);
``pip install --no-deps torch-em bioimage-cpp`` (why: ``bench/peers.py``).

torch-em is imported without its package ``__init__`` files: ``bench/peers.py``.

    python bench/compare_peers.py [--networks tiny,unet12] [--sizes 64,256,256x3,128,704,704x1]
                                  [--all-peers | --peers monai,...] [--no-scripts] [--dir /tmp/blockpred-peers]
                                  [--json F]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from blockpred.io.synthetic import make_em_volume
from blockpred.io import create_volume
from peers import create_output, import_torch_em_prediction, make_network, run_monai, run_torch_em, window

#: The peers' labels and the names ``bench/peers.py`` runs them by as scripts.
PEER_NAMES = {"torch-em predict_with_halo": "torch-em-halo",
              "torch-em predict_with_halo_pipelined": "torch-em-pipelined",
              "MONAI sliding_window_inference": "monai"}


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def make_volume(root: Path, shape: tuple[int, ...]) -> str:
    path = root / f"raw-{'x'.join(map(str, shape))}.zarr"
    if not path.exists():
        volume = create_volume(str(path), spatial_shape=shape, num_channels=None, dtype="uint8",
                               chunk_shape=(64, 64, 64), ome=False, overwrite=True)
        volume.write(volume.box, make_em_volume(shape))
        volume.close()
    return str(path)


def parse_sizes(text: str) -> list[tuple[tuple[int, int, int], int]]:
    """``64,256,256x3,128,704,704x1`` -> [((64, 256, 256), 3), ((128, 704, 704), 1)]."""
    sizes = []
    for match in re.finditer(r"(\d+),(\d+),(\d+)x(\d+)", text):
        z, y, x, rounds = (int(v) for v in match.groups())
        sizes.append(((z, y, x), rounds))
    if not sizes:
        raise SystemExit(f"--sizes: expected Z,Y,XxROUNDS[,...], got {text!r}")
    return sizes


# --------------------------------------------------------------------------- the tools


def run_blockpred(source: str, output: str, model_args: list[str], cache: Path) -> tuple[float, float, str, str]:
    """The whole command as a user runs it: (wall s, pipeline s, its chosen: line, its time: line)."""
    env = dict(os.environ, BLOCKPRED_CACHE_DIR=str(cache))
    command = [sys.executable, "-m", "blockpred", "run", source, output, *model_args, "--overwrite", "--no-progress"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"blockpred run failed ({' '.join(command)}): {result.stderr.strip()[-2000:]}")
    lines = result.stdout.strip().splitlines()
    pipeline = float(re.search(r" in ([\d.]+) s \(", lines[-1]).group(1))
    chosen = next((line for line in lines if line.startswith("chosen:")), "chosen: (not printed)")
    timing = next((line for line in lines if line.startswith("time:")), "time: (not printed)")
    backend = next((line for line in lines if line.startswith("backend:")), "")
    return wall, pipeline, f"{chosen}; {backend}" if backend else chosen, timing


def run_blockpred_api(source: str, output: str, model_args: list[str], cache: Path, calls: int) -> list[dict]:
    """``blockpred.predict`` as a notebook user calls it, ``calls`` times in one process of its own
    (``bench/predict_api.py``: imports first, untimed; the first call on ``cache`` as it is): each
    call's wall and pipeline seconds and what it chose."""
    command = [sys.executable, str(Path(__file__).with_name("predict_api.py")), source, output,
               "--cache", str(cache), "--calls", str(calls), *model_args]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])["calls"]


def read_output(path: str) -> np.ndarray:
    import zarr

    node = zarr.open(path, mode="r")
    array = node if isinstance(node, zarr.Array) else node["0"]
    return np.asarray(array[...])


def run_script(peer: str, network: str, source: str, output: str, like: str, root: Path,
               threads: int) -> float:
    """``bench/peers.py`` as the user of a peer runs it, a subprocess: wall seconds from start to exit."""
    command = [sys.executable, str(Path(__file__).with_name("peers.py")), peer, network, source, output,
               "--like", like, "--dir", str(root), "--threads", str(threads)]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {result.stderr.strip()[-2000:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--networks", default="tiny,unet12")
    parser.add_argument("--sizes", default="64,256,256x3,128,704,704x1",
                        help="volume shapes and their rounds, Z,Y,XxROUNDS (default 64,256,256x3,128,704,704x1)")
    parser.add_argument("--all-peers", action="store_true", help="also torch-em predict_with_halo (not pipelined)")
    parser.add_argument("--peers", default=None,
                        help="only these peers, by their script names (monai, torch-em-pipelined, torch-em-halo)")
    parser.add_argument("--no-scripts", action="store_true",
                        help="time the peers in-process only, not also as scripts (bench/peers.py)")
    parser.add_argument("--no-api", action="store_true", help="leave out blockpred.predict in one process")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for the peers (default 2)")
    parser.add_argument("--dir", default="/tmp/blockpred-peers")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    print(f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"torch threads {torch.get_num_threads()}; monai {version('monai')}, torch-em {version('torch-em')}, "
          f"blockpred {version('blockpred')}", flush=True)
    prediction, stubbed = import_torch_em_prediction()
    functions = {"torch-em-halo": prediction.predict_with_halo,
                 "torch-em-pipelined": prediction.predict_with_halo_pipelined}
    labels = [label for label, peer in PEER_NAMES.items()
              if (peer in args.peers.split(",") if args.peers else args.all_peers or peer != "torch-em-halo")]

    report = []
    for shape, rounds in parse_sizes(args.sizes):
        source = make_volume(root, shape)
        mvox = float(np.prod(shape)) / 1e6
        for name in args.networks.split(","):
            net, model_args, halo = make_network(name, root)
            with torch.no_grad():
                net(torch.zeros((1, 1) + window(halo)))  # the in-process peers' warm-up: kernels created, untimed
            tag = f"{name}-{'x'.join(map(str, shape))}"
            cache = root / f"cache-{tag}"
            shutil.rmtree(cache, ignore_errors=True)
            bp_out = str(root / f"{tag}-blockpred.zarr")

            def in_process(peer: str) -> tuple[float, np.ndarray | None]:
                if peer == "monai":
                    return run_monai(source, net, halo)
                output = create_output(str(root / f"{tag}-{peer}.zarr"), (2,) + shape, bp_out)
                return run_torch_em(functions[peer], source, net, halo, output), None

            times: dict[str, list[float]] = {}
            first = run_blockpred(source, bp_out, model_args, cache)
            print(f"{tag}: blockpred first run (empty cache) {first[0]:.2f} s wall, pipeline {first[1]:.2f} s; "
                  f"{first[2]}; {first[3]}", flush=True)
            api_cache, api_out = root / f"cache-{tag}-api", str(root / f"{tag}-blockpred-api.zarr")
            shutil.rmtree(api_cache, ignore_errors=True)
            api_calls = run_blockpred_api(source, api_out, model_args, api_cache, rounds + 1) if not args.no_api \
                else [{"wall_s": float("nan"), "pipeline_s": float("nan"), "chosen": "not run"}] * (rounds + 1)
            api_first = api_calls[0]
            times["blockpred.predict (cached)"] = [call["wall_s"] for call in api_calls[1:]]
            print(f"{tag}: blockpred.predict in one process: first call (empty cache) {api_first['wall_s']:.2f} s "
                  f"(pipeline {api_first['pipeline_s']:.2f} s; {api_first['chosen']}), then "
                  f"{', '.join(f'{t:.2f}' for t in times['blockpred.predict (cached)'])} s", flush=True)
            pipelines, chosen, outputs = [], first[2], {}
            for round_ in range(rounds):
                wall, pipeline, chosen, _ = run_blockpred(source, bp_out, model_args, cache)
                times.setdefault("blockpred run (cached)", []).append(wall)
                pipelines.append(pipeline)
                print(f"{tag} round {round_ + 1}/{rounds}: blockpred run {wall:.2f} s (pipeline {pipeline:.2f} s)",
                      flush=True)
                for label in labels:
                    peer = PEER_NAMES[label]
                    seconds, result = in_process(peer)
                    times.setdefault(label, []).append(seconds)
                    if round_ == 0:
                        outputs[label] = result
                    print(f"{tag} round {round_ + 1}/{rounds}: {label} {seconds:.2f} s", flush=True)
                    if not args.no_scripts:
                        seconds = run_script(peer, name, source, str(root / f"{tag}-{peer}-script.zarr"), bp_out,
                                             root, args.threads)
                        times.setdefault(f"{label} (script)", []).append(seconds)
                        print(f"{tag} round {round_ + 1}/{rounds}: {label} as a script {seconds:.2f} s", flush=True)
            reference = read_output(bp_out)
            margin = max(halo)
            interior = (slice(None),) + tuple(slice(margin, n - margin) for n in shape)
            diffs = {}
            for label in labels:
                other = outputs.get(label)
                if other is None:
                    other = read_output(str(root / f"{tag}-{PEER_NAMES[label]}.zarr"))
                inner = np.abs(other[interior].astype(np.float64) - reference[interior])
                diffs[label] = float(inner.max()) if inner.size else float("nan")
                if not args.no_scripts:
                    script = read_output(str(root / f"{tag}-{PEER_NAMES[label]}-script.zarr"))
                    inner = np.abs(script[interior].astype(np.float64) - reference[interior])
                    diffs[f"{label} (script)"] = float(inner.max()) if inner.size else float("nan")
            medians = {label: statistics.median(t) for label, t in times.items()}
            cached = medians["blockpred run (cached)"]
            best_peer = min(labels, key=medians.get)
            row = {
                "network": name, "shape": list(shape), "mvox": mvox, "halo": list(halo), "rounds": rounds,
                "chosen": chosen.removeprefix("chosen: "), "first_run_s": first[0], "first_pipeline_s": first[1],
                "chosen_first": first[2].removeprefix("chosen: "), "first_time_line": first[3],
                "cached_run_s": cached,
                "cached_pipeline_s": statistics.median(pipelines), "peers_s": {k: v for k, v in medians.items()
                                                                               if not k.startswith("blockpred")},
                "best_peer": best_peer, "speedup_cached": medians[best_peer] / cached,
                "speedup_first": medians[best_peer] / first[0], "max_abs_diff_interior": diffs, "runs": times,
                "api_first_s": api_first["wall_s"], "api_first_pipeline_s": api_first["pipeline_s"],
                "api_chosen_first": api_first["chosen"], "api_cached_s": medians["blockpred.predict (cached)"],
                "api_speedup_first": medians[best_peer] / api_first["wall_s"],
                "api_speedup_cached": medians[best_peer] / medians["blockpred.predict (cached)"],
            }
            if not args.no_scripts:
                best_script = min((f"{label} (script)" for label in labels), key=medians.get)
                row.update(best_script=best_script, script_speedup_cached=medians[best_script] / cached,
                           script_speedup_first=medians[best_script] / first[0])
            report.append(row)
            print(f"{tag}: best peer in-process {best_peer} {medians[best_peer]:.2f} s; blockpred.predict in-process "
                  f"cached {row['api_cached_s']:.2f} s ({row['api_speedup_cached']:.2f}x), first call "
                  f"{row['api_first_s']:.2f} s ({row['api_speedup_first']:.2f}x); blockpred run cached {cached:.2f} s "
                  f"({row['speedup_cached']:.2f}x), first run {first[0]:.2f} s ({row['speedup_first']:.2f}x); "
                  f"chosen {row['chosen']}", flush=True)
            if not args.no_scripts:
                print(f"{tag}: best peer as a script {row['best_script']} {medians[row['best_script']]:.2f} s: "
                      f"blockpred cached {row['script_speedup_cached']:.2f}x, first run "
                      f"{row['script_speedup_first']:.2f}x", flush=True)

    print()
    print("| network | volume | blockpred run: cached (first run, empty cache) | blockpred.predict in-process: "
          "cached (first call) | torch-em pipelined: in-process (script) | MONAI: in-process (script) | "
          "in-process, best peer / blockpred.predict: cached (first) | as scripts, best peer / blockpred run: "
          "cached (first) | best peer in-process / blockpred run: cached (first) | blockpred chose |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for r in report:
        peers = r["peers_s"]
        cells = []
        for label in ("torch-em predict_with_halo_pipelined", "MONAI sliding_window_inference"):
            cells.append(f"{peers.get(label, nan):.2f} s ({peers.get(label + ' (script)', nan):.2f} s)")
        scripts = (f"**{r['script_speedup_cached']:.2f}x** ({r['script_speedup_first']:.2f}x)"
                   if "best_script" in r else "not run")
        print(f"| {r['network']} | {'x'.join(map(str, r['shape']))} ({r['mvox']:.1f} Mvox) | "
              f"{r['cached_run_s']:.2f} s, pipeline {r['cached_pipeline_s']:.2f} ({r['first_run_s']:.2f} s) | "
              f"{r['api_cached_s']:.2f} s ({r['api_first_s']:.2f} s) | {cells[0]} | {cells[1]} | "
              f"**{r['api_speedup_cached']:.2f}x** (**{r['api_speedup_first']:.2f}x**) | {scripts} | "
              f"{r['speedup_cached']:.2f}x ({r['speedup_first']:.2f}x) | {r['chosen']} |")
    for r in report:
        diffs = ", ".join(f"{k} {v:.1e}" for k, v in r["max_abs_diff_interior"].items())
        print(f"  {r['network']} {'x'.join(map(str, r['shape']))}: max |diff| to blockpred in the interior: {diffs}")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "monai": version("monai"),
                                               "torch_em": version("torch-em"), "stubs": stubbed,
                                               "threads": args.threads, "rows": report}, indent=2))


if __name__ == "__main__":
    main()
