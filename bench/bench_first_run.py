"""Where a first run's start-up goes, per network: ``blockpred -v run`` on an empty cache, its log lines timed.

For each network of ``bench/peers.py`` (the TorchScript files of ``tests/scripted.py`` among them) the whole
command runs as a user types it, on the synthetic EM volume of ``bench/compare_peers.py``, with an empty cache
(``--first``), then once more on the cache it left (the cached run).  The start-up (process start to the
pipeline's first block) is split at blockpred's ``-v`` log lines into phases, each named by the line that ends it:

    imports and model load | grid (dry runs) | receptive field | memory count |
    the start block's dry run, then backend, layouts and sizes measured (OpenVINO's routes, conversion and
    check among them) | pipeline

    python bench/bench_first_run.py [--networks loop-list,monai-unet,...] [--shape 64,256,256] [--dir D]
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from datetime import datetime
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent)]
from command import run_blockpred  # noqa: E402
from compare_peers import make_volume  # noqa: E402
from peers import make_network  # noqa: E402

#: Phases, each ended by the first log line that holds its marker (after the phase before it).
PHASES = (("imports, model load", "loaded model"), ("grid", "network grid"), ("receptive field", "receptive field"),
          ("memory counted", "memory of a pass"), ("dry run, measured (backend, layout, sizes)", "chosen:"))
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def run(source: str, output: str, model_args: list[str], cache: Path) -> tuple[float, list[tuple[float, str]], str]:
    """The whole command with ``-v``: (wall s, its log lines as (seconds from the start, text), stdout)."""
    result = run_blockpred([source, output, *model_args, "--overwrite", "--no-progress"], cache, verbose=True)
    lines = []
    for line in result["stderr"].splitlines():
        match = STAMP.match(line)
        if match:
            at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - result["start"]
            lines.append((at, line[match.end():]))
    return result["wall_s"], lines, result["stdout"]


def phases(lines: list[tuple[float, str]], stdout: str) -> tuple[list[tuple[str, float]], float]:
    """Seconds per :data:`PHASES` (a phase whose line is missing is folded into the next) and the start-up."""
    started = float(re.search(r"started in ([\d.]+) s", stdout).group(1))
    out, last, index = [], 0.0, 0
    for name, marker in PHASES[:-1]:
        found = next((i for i in range(index, len(lines)) if marker in lines[i][1]), None)
        if found is None:
            out.append((name, 0.0))
            continue
        out.append((name, lines[found][0] - last))
        last, index = lines[found][0], found + 1
    out.append((PHASES[-1][0], started - last))
    return out, started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--networks", default="unet12,loop-list,monai-unet,monai-basicunet,torch-em-unet3d")
    parser.add_argument("--shape", default="64,256,256")
    parser.add_argument("--dir", default="/tmp/blockpred-first-run")
    args = parser.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    shape = tuple(int(v) for v in args.shape.split(","))
    source = make_volume(root, shape)
    rows = []
    for name in args.networks.split(","):
        _, model_args, _ = make_network(name, root)
        cache = root / f"cache-{name}"
        shutil.rmtree(cache, ignore_errors=True)
        first = run(source, str(root / f"{name}.zarr"), model_args, cache)
        cached = run(source, str(root / f"{name}.zarr"), model_args, cache)
        split, started = phases(first[1], first[2])
        backend = next((line for line in first[2].splitlines() if line.startswith("backend:")), "backend: torch")
        routes = [text.split(": ", 1)[1] for _, text in first[1] if "--backend openvino:" in text]
        rows.append((name, first[0], started, split, cached[0], backend, routes))
        print(f"{name}: first run {first[0]:.2f} s (started in {started:.2f} s: "
              + ", ".join(f"{n} {s:.2f}" for n, s in split) + f"), cached run {cached[0]:.2f} s; {backend}",
              flush=True)
        for route in routes:
            print(f"  {route[:160]}", flush=True)
    print()
    print("| network | first run | started in | " + " | ".join(n for n, _ in PHASES) + " | cached run | backend |")
    print("|---|---|---|" + "---|" * len(PHASES) + "---|---|")
    for name, wall, started, split, cached, backend, _ in rows:
        print(f"| {name} | {wall:.2f} s | {started:.2f} s | " + " | ".join(f"{s:.2f}" for _, s in split)
              + f" | {cached:.2f} s | {backend.removeprefix('backend: ')[:60]} |")


if __name__ == "__main__":
    main()
