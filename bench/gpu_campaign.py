"""Issue 37's GPU campaign in one device call: what a user of one GPU gets from today's code.

Every step is the command a user types (``python3 -m blockpred run|bench ...``), run as a
subprocess with the GPU sampled through NVML every 50 ms.  For a ``run``, the GPU's busy share
is taken over the run's pipeline (from its first block to its end, from the summary's
``started_s`` and ``seconds``) and over the whole command; the GPU memory peak is NVML's
``memory.used`` above what was used before the command.  Steps go in the order of
``--parts`` and each has a time limit; a step that would start after ``--budget`` seconds is
skipped (and says so), so the call ends with its results on disk.

Output (under ``$OUT``): ``log.txt`` (every command's stderr), ``results.jsonl`` (one object per
step) and ``results.md`` (the table), packed at the end with the peers' and bench JSON files.

Issue 47: what users feel.  Each ``run`` step's ``-v`` log gives its start-up phases
(``startup``: seconds from the command's start to the model loaded, the first dry run, the
kernel-search choice and the pipeline's start) and its longest gaps (``gaps``: where the start-up
went); a network's cached run is set against model only at its choice (``whole_vs_model``: the
command's Mvox/s, start-up included, over the network's alone).  The peers part runs blockpred's
fp32 prediction of the peers' region first, then each peer in a process of its own (its whole
script, beside its in-process time), each compared with that reference.

    python3 bench/gpu_campaign.py --budget 540 --parts env,cremi,unet32,peers,seed,blocks,gputests,suite

On the lent machine: the wheels of ``bash ../shared/tools/device-wheels.sh monai==1.6.1 torch-em==0.10.9
bioimage-cpp==0.10.0`` and a copy of ``../shared/realdata`` (ignored, as ``.realdata``) travel with the tree; the
command installs the wheels and copies ``.realdata`` to ``../shared/realdata`` before this script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

OUT = Path(os.environ.get("OUT", "/tmp/blockpred-gpu"))
WORK = OUT / "work"
LOG = OUT / "log.txt"
SEED = ["--block", "55,594,594", "--halo", "5,50,50"]
#: The networks by name; ``--stand-in`` replaces both (a dry run of the campaign on a CPU machine).
NETS = {"cremi2018": "cremi2018", "unet32": "unet32"}
PY = sys.executable


def log(text: str) -> None:
    print(text, flush=True)
    with open(LOG, "a") as handle:
        handle.write(text + "\n")


class Sampler:
    """NVML utilisation and memory of GPU 0 every ``interval`` seconds, in a thread."""

    def __init__(self, interval: float = 0.05):
        self.interval, self.samples, self._stop = interval, [], threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle, self._nvml = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml
        except Exception as err:  # no GPU: the campaign's dry run on a CPU machine
            self._handle, self._nvml = None, None
            log(f"(no NVML: {err})")

    def read(self) -> tuple[float, float, float]:
        if self._handle is None:
            return time.time(), 0.0, 0.0
        util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
        used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used
        return time.time(), float(util), used / 2**30

    def __enter__(self):
        self.baseline = self.read()[2]
        self.samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(self.read())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def busy(self, start: float | None = None, end: float | None = None) -> float | None:
        chosen = [u for t, u, _ in self.samples if (start is None or t >= start) and (end is None or t <= end)]
        return round(sum(chosen) / len(chosen), 1) if chosen else None

    def peak_gib(self) -> float | None:
        return round(max(m for _, _, m in self.samples) - self.baseline, 2) if self.samples else None


class Campaign:
    def __init__(self, budget: float, device: str):
        self.end = time.time() + budget
        self.device = device
        self.sampler = Sampler()
        self.results: list[dict] = []

    def left(self) -> float:
        return self.end - time.time()

    def step(self, label: str, argv: list[str], limit: float, need: float = 20.0,
             events: Path | None = None) -> dict | None:
        """Run ``argv`` sampled; the parsed ``--json`` summary (its last stdout line) and the GPU figures."""
        if self.left() < need:
            log(f"-- {label}: skipped, {self.left():.0f} s left")
            return None
        limit = max(5.0, min(limit, self.left() - 5))
        log(f"== {label} (limit {limit:.0f} s): {shlex.join(argv)}")
        start = time.time()
        stderr_path = WORK / f"stderr-{len(self.results)}.txt"
        with self.sampler, open(stderr_path, "w") as err:
            try:
                done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, text=True, timeout=limit)
                rc, stdout = done.returncode, done.stdout
            except subprocess.TimeoutExpired as exc:
                rc, stdout = "timeout", exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        wall = time.time() - start
        stderr = stderr_path.read_text(errors="replace")
        with open(LOG, "a") as handle:
            handle.write(stderr)
        objects = []
        for line in stdout.strip().splitlines():
            if line.startswith("{"):
                try:
                    objects.append(json.loads(line))
                except ValueError:
                    pass
        summary = objects[-1] if objects else None
        record = {"label": label, "command": shlex.join(argv), "rc": rc, "wall_s": round(wall, 2),
                  "gpu_busy_all": self.sampler.busy(), "gpu_mem_peak_gib": self.sampler.peak_gib()}
        if summary and summary.get("started_s") is not None and summary.get("seconds"):
            first = start + summary["started_s"]
            record["gpu_busy_pipeline"] = self.sampler.busy(first, first + summary["seconds"])
            record.update({k: summary.get(k) for k in (
                "mvox_per_s", "seconds", "started_s", "block", "halo", "batch_size", "precision", "chosen",
                "voxels", "blocks", "stages_s", "backend", "peak_rss_bytes", "precision_note", "out_of_memory")})
        elif len(objects) > 1:
            record["lines"] = objects
        elif summary is not None:
            record["summary"] = summary
        if rc != 0 or not objects:
            record["stdout_tail"] = stdout[-1500:]
        startup = startup_phases(stderr, start)
        if startup:
            record.update(startup)
        if events is not None and events.exists():  # --progress-json: when the first block was done
            lines = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
            begin = next((e["time"] for e in lines if e.get("event") == "start"), None)
            first = next((e["time"] for e in lines if e.get("event") == "progress" and e.get("blocks_done")), None)
            if begin is not None and first is not None:
                record["first_block_done_after_pipeline_start_s"] = round(first - begin, 2)
        log(f"   rc {rc}, {wall:.1f} s: " + json.dumps({k: v for k, v in record.items() if k not in ("command",)}))
        self.results.append(record)
        with open(OUT / "results.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")
        return record

    def run(self, label: str, source: str, target: str, *options: str, limit: float = 120) -> dict | None:
        """``blockpred -v run`` (its log, timestamped, shows where the start-up goes), its progress events kept."""
        events = WORK / f"events-{len(self.results)}.jsonl"
        return self.step(label, [PY, "-m", "blockpred", "-v", "run", source, target, "--device", self.device,
                                 "--json", "--no-progress", "--overwrite", "--progress-json", str(events), *options],
                         limit, events=events)

    def model_only(self, label: str, *options: str, limit: float = 90) -> dict | None:
        path = WORK / f"{label}.json"
        record = self.step(label, [PY, "-m", "blockpred", "bench", "--device", self.device, "--iterations", "10",
                                   "--json", str(path), *options], limit)
        if record is not None and path.exists():
            rows = json.loads(path.read_text())["results"]
            record["model_only"] = [{k: r.get(k) for k in (
                "precision", "batch_size", "block", "input_shape", "mean_s", "output_mvox_per_s", "peak_memory_bytes",
                "load", "backend", "memory_format", "error")} for r in rows]
            log("   model only: " + "; ".join(
                f"{r.get('precision')} b{r.get('batch_size')} {r.get('output_mvox_per_s') or 0:.1f} Mvox/s "
                f"({(r.get('mean_s') or 0) * 1e3:.1f} ms, {(r.get('peak_memory_bytes') or 0) / 2**30:.2f} GiB)"
                for r in rows))
            with open(OUT / "results.jsonl", "a") as handle:
                handle.write(json.dumps({"label": label + " (rows)", "model_only": record["model_only"]}) + "\n")
        return record


#: The ``-v`` log lines that mark a run's start-up phases (the first line matching each).
PHASES = {"loaded": "loaded model", "first_dry_run": "dry run ", "kernel_search": "kernel search",
          "pipeline": "predicting "}
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \w+ (.*)$")


def startup_phases(stderr: str, start: float) -> dict:
    """From a ``-v`` log: the seconds from the command's ``start`` (time.time()) to each of :data:`PHASES`, and the
    five longest gaps between log lines before the pipeline, each with the line that ended it."""
    lines = []
    for line in stderr.splitlines():
        found = _STAMP.match(line)
        if found:
            stamp = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            lines.append((stamp - start, found.group(2)))
    if not lines:
        return {}
    phases = {}
    for name, marker in PHASES.items():
        at = next((t for t, text in lines if marker in text), None)
        if at is not None:
            phases[name] = round(at, 2)
    end = next((i for i, (_, text) in enumerate(lines) if PHASES["pipeline"] in text), len(lines) - 1)
    gaps = sorted(((lines[i][0] - (lines[i - 1][0] if i else 0.0), lines[i][1][:90]) for i in range(end + 1)),
                  reverse=True)[:5]
    return {"startup": phases, "gaps": [[round(g, 2), text] for g, text in gaps]}


def chosen_options(record: dict | None) -> list[str]:
    """bench options for the block, halo, batch, precision and layout a run chose."""
    if not record or not record.get("block"):
        return []
    layout = "channels_last" if "channels_last" in (record.get("chosen") or "") else "contiguous"
    return ["--block", ",".join(map(str, record["block"])), "--halo", ",".join(map(str, record["halo"])),
            "--batch-size", str(record["batch_size"]), "--precision", record["precision"],
            "--memory-format", layout] + (["--backend", record["backend"]] if record.get("backend") in (
                "torch", "openvino", "onnxruntime") else [])


def make_volume(path: Path, shape: tuple[int, int, int]) -> None:
    """A uint8 zarr volume with smooth structure and noise (uniform noise alone is no network's input)."""
    import numpy as np
    import zarr

    start = time.time()
    array = zarr.create_array(str(path), shape=shape, chunks=(64, 256, 256), dtype="uint8", overwrite=True)
    rng = np.random.default_rng(0)
    y = np.sin(np.arange(shape[1], dtype=np.float32) / 23.0)[:, None]
    x = np.cos(np.arange(shape[2], dtype=np.float32) / 31.0)[None, :]
    plane = (100 + 80 * y * x).astype(np.uint8)
    for k in range(0, shape[0], 64):
        depth = min(64, shape[0] - k)
        slab = rng.integers(0, 60, (depth, *shape[1:]), dtype=np.uint8)
        slab += plane
        slab[::3] += np.uint8(15)  # some structure along z too
        array[k:k + depth] = slab
    log(f"   volume {shape} in {time.time() - start:.1f} s")


def part_env(c: Campaign) -> None:
    subprocess.run("nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit "
                   f"--format=csv >> {LOG} 2>&1; nproc >> {LOG}", shell=True)
    code = r"""
import importlib.util, os, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      torch.cuda.get_device_name(), "cores", os.cpu_count())
for name in ("tensorrt", "torch_tensorrt", "onnxruntime", "zarr", "dask", "tensorstore", "monai", "torch_em"):
    print(name, "present" if importlib.util.find_spec(name) else "MISSING")
try:
    import onnxruntime; print("onnxruntime providers", onnxruntime.get_available_providers())
except Exception as err: print("onnxruntime", err)
x = torch.empty(2**31, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
def timed(f, n):
    for _ in range(3): f()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); [f() for _ in range(n)]; e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) / 1e3 / n
t = timed(lambda: y.copy_(x), 20); print(f"device copy {2 * x.numel() / t / 1e9:.0f} GB/s (read + write)")
t = timed(lambda: a @ b, 20); print(f"bf16 matmul {2 * 8192**3 / t / 1e12:.0f} TFLOP/s")
"""
    c.step("env", [PY, "-c", code], 60)


def part_defaults(c: Campaign, volume: Path, name: str) -> None:
    """The network at the defaults: a first run (empty cache), a cached one, and model only at what they chose."""
    out = f"/tmp/blockpred-gpu-{name}.zarr"
    first = c.run(f"{name} default, first run (empty cache)", str(volume), out, "--model", NETS[name], limit=150)
    cached = c.run(f"{name} default, cached", str(volume), out, "--model", NETS[name], limit=90)
    best = cached if cached and cached.get("block") else first
    if best and best.get("block"):
        alone = c.model_only(f"{name} model only at the default's choice", "--model", NETS[name],
                             *chosen_options(best), limit=60)
        rows = [r for r in (alone or {}).get("model_only", []) if r.get("output_mvox_per_s")]
        if rows and best.get("voxels"):
            whole = best["voxels"] / 1e6 / best["wall_s"]
            ratio = {"label": f"{name}: whole command (cached) over model only", "whole_mvox_per_s": round(whole, 2),
                     "model_mvox_per_s": rows[0]["output_mvox_per_s"],
                     "whole_vs_model": round(whole / rows[0]["output_mvox_per_s"], 3)}
            log("   " + json.dumps(ratio))
            with open(OUT / "results.jsonl", "a") as handle:
                handle.write(json.dumps(ratio) + "\n")


def part_seed(c: Campaign, volume: Path) -> None:
    out = "/tmp/blockpred-gpu-cremi.zarr"
    c.run("cremi2018 seed block, in process (default)", str(volume), out, "--model", NETS["cremi2018"], *SEED, limit=80)
    c.run("cremi2018 seed block, --workers 1 (dask)", str(volume), out, "--model", NETS["cremi2018"], *SEED,
          "--workers", "1", limit=90)
    c.model_only("cremi2018 model only, seed block, contiguous", "--model", NETS["cremi2018"], *SEED,
                 "--batch-size", "1", "--precision", "bf16,fp16", "--memory-format", "contiguous", limit=60)
    c.model_only("cremi2018 model only, seed block, channels_last", "--model", NETS["cremi2018"], *SEED,
                 "--batch-size", "1", "--precision", "bf16,fp16", "--memory-format", "channels_last", limit=60)


def part_peers(c: Campaign, volume: Path, depth: int, shape: tuple[int, int, int]) -> None:
    out = "/tmp/blockpred-gpu-cremi-peers.zarr"
    roi = f"0:{depth},0:{shape[1]},0:{shape[2]}"
    mine = c.run(f"cremi2018 default (cached) on z 0:{depth}", str(volume), out, "--model", NETS["cremi2018"],
                 "--roi", roi, limit=80)
    if not mine or not mine.get("block"):
        return
    block, halo = ",".join(map(str, mine["block"])), ",".join(map(str, mine["halo"]))
    reference = "/tmp/blockpred-gpu-cremi-fp32.zarr"  # fp32, TF32 off: what every output is held against
    c.run(f"cremi2018 fp32 reference on z 0:{depth}", str(volume), reference, "--model", NETS["cremi2018"],
          "--roi", roi, "--block", block, "--halo", halo, "--precision", "fp32", "--memory-format", "contiguous",
          limit=120)
    peers = [PY, str(Path(__file__).with_name("gpu_peers.py")), str(volume), out, "--block", block, "--halo", halo,
             "--depth", str(depth), "--deadline", str(c.end - 30), "--model", NETS["cremi2018"], "--device", c.device,
             "--dir", "/tmp/blockpred-gpu-peers", "--reference", reference]
    c.step("blockpred (auto) against the fp32 reference", peers + ["--peers", "blockpred:auto"], 60, need=30)
    for peer in ("torch-em:bf16", "monai:bf16"):  # one process each: the peer's whole script, start-up included
        c.step(f"peer {peer}, whole script", peers + ["--peers", peer], 150, need=60)
    c.run(f"cremi2018 default (cached) on z 0:{depth}, again after the peers", str(volume), out, "--model",
          NETS["cremi2018"], "--roi", roi, limit=80)


def part_blocks(c: Campaign) -> None:
    # Larger than the seed block and under the 2^31-element limit (cremi2018 makes 24 maps per input voxel; see
    # blockpred/tuning/tensors.py): 55x1188x1188 (input 65x1288x1288, 2.6 G elements) is over it.
    for block in ("110,594,594", "55,864,864"):
        c.model_only(f"cremi2018 model only, block {block}", "--model", NETS["cremi2018"], "--block", block,
                     "--halo", "5,50,50", "--batch-size", "1", "--precision", "bf16,fp16", "--memory-format", "channels_last",
                     "--iterations", "5", limit=60)


def part_gputests(c: Campaign) -> None:
    # A GPU machine lacks some test-only packages (ome-zarr-models, neuroglancer): their files fail to collect, and
    # hold no GPU test.  The real data the exactness test reads must lie at ../shared/realdata there.
    c.step("pytest -m gpu", [PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs", "-s",
                             "--continue-on-collection-errors", "--tb=short", "tests"], 120, need=40)


def part_suite(c: Campaign) -> None:
    c.step("pytest (the rest of the suite, 8 workers)",
           [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=line", "-n", "8", "-m", "not gpu", "tests"],
           c.left() - 10, need=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=540, help="seconds after which no step starts")
    parser.add_argument("--parts", default="env,cremi,unet32,peers,seed,blocks,gputests,suite")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="220,2304,2304", help="the volume, Z,Y,X")
    parser.add_argument("--peer-depth", type=int, default=110, help="the peers predict z in [0, this)")
    parser.add_argument("--stand-in", default=None, help="run this network for both (a dry run on the CPU)")
    parser.add_argument("--seed-block", default=None, help="Z,Y,X instead of the seed's 55,594,594")
    args = parser.parse_args()
    if args.stand_in:
        NETS.update(cremi2018=args.stand_in, unet32=args.stand_in)
    if args.seed_block:
        SEED[1] = args.seed_block
    WORK.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("BLOCKPRED_CACHE_DIR", "/tmp/blockpred-gpu-cache")
    os.environ["PYTHONUNBUFFERED"] = "1"
    c = Campaign(args.budget, args.device)
    volume = Path("/tmp/blockpred-gpu-in.zarr")
    parts = args.parts.split(",")
    shape = tuple(int(v) for v in args.shape.split(","))
    if set(parts) & {"cremi", "seed", "unet32", "peers"}:
        make_volume(volume, shape)
    for part in parts:
        try:
            {"env": lambda: part_env(c), "cremi": lambda: part_defaults(c, volume, "cremi2018"),
             "seed": lambda: part_seed(c, volume), "unet32": lambda: part_defaults(c, volume, "unet32"),
             "peers": lambda: part_peers(c, volume, args.peer_depth, shape), "blocks": lambda: part_blocks(c),
             "gputests": lambda: part_gputests(c), "suite": lambda: part_suite(c)}[part]()
        except Exception as err:  # one part's failure must not lose the others
            log(f"!! part {part} failed: {type(err).__name__}: {err}")
    write_table(c.results)
    subprocess.run(["tar", "czf", str(OUT / "work.tgz"), "-C", str(OUT), "work"], check=False)
    subprocess.run(["rm", "-rf", str(WORK)], check=False)


def write_table(results: list[dict]) -> None:
    lines = ["| step | rc | wall s | Mvox/s | started s | first block done s | pipeline s | block / batch / precision | GPU busy "
             "(pipeline / all) | GPU mem GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        choice = f"{r.get('block')} / {r.get('batch_size')} / {r.get('precision')}" if r.get("block") else ""
        lines.append(f"| {r['label']} | {r['rc']} | {r['wall_s']} | {r.get('mvox_per_s', '')} | "
                     f"{r.get('started_s', '')} | {r.get('first_block_done_after_pipeline_start_s', '')} | "
                     f"{r.get('seconds', '')} | {choice} | "
                     f"{r.get('gpu_busy_pipeline', '')} / {r.get('gpu_busy_all', '')} | {r.get('gpu_mem_peak_gib', '')} |")
        for row in r.get("model_only", []):
            lines.append(f"| ↳ model only {row.get('precision')} {row.get('memory_format') or ''} b{row.get('batch_size')}"
                         f" {row.get('block')} | | | {round(row.get('output_mvox_per_s') or 0, 1)} | | | {round(row.get('mean_s') or 0, 4)} | | "
                         f"{(row.get('load') or {}).get('label', '')} | "
                         f"{round((row.get('peak_memory_bytes') or 0) / 2**30, 2)} |")
    (OUT / "results.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))


if __name__ == "__main__":
    main()
