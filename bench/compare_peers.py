"""blockpred against peer tools: one volume, one network, one set of weights, one run.

Times, on the same synthetic EM-like uint8 zarr volume and the same network
object (the ``tiny`` preset, built once: every tool gets that module, the dask
worker a pickled copy of it):

* ``blockpred (local)``: ``blockpred.predict(..., local=True)``, in this process;
* ``blockpred (dask, 1 worker)``: ``blockpred.predict(..., workers=1)``, the
  default path (a local dask cluster; since issue 12 its one CPU worker runs in this process);
* ``torch-em predict_with_halo`` and ``predict_with_halo_pipelined`` (the latter
  when the installed torch-em has it): same block shape and halo as blockpred,
  reading the zarr array lazily and writing a zarr array with the chunks and
  codecs of blockpred's output;
* ``MONAI sliding_window_inference`` with its defaults (overlap 0.25, blend mode
  ``constant``, zero padding where the volume is smaller than the window),
  ``roi_size`` = blockpred's network input shape (block + 2 * halo) and
  ``sw_batch_size`` 1.  It needs the whole volume in memory as a torch tensor
  (and holds the whole output there): the table's seconds are the call on the
  in-memory tensor, its wall time adds reading and normalising the volume; the
  output is not written to disk;
* ``network alone``: the compute floor, the network's forward pass on one
  window of that input shape as many times as blockpred has blocks (no
  reading, padding, normalising, blending or writing).

Every tool sees the same input values: uint8 -> float32, times float32(1/255),
the exact operations of blockpred's default (``auto``) normalisation.  Runs
alternate between tools (``--repeats`` rounds, after one untimed warm-up forward
pass) and the table shows medians.  ``torch.set_num_threads`` is set to
``--threads`` (default 2) in this process; blockpred's dask worker gets its own
share of the cores from blockpred (``OMP_NUM_THREADS``).

Agreement with blockpred (local) is max |diff| over all voxels and over the
interior (``--margin`` voxels, default the halo, away from every face):

* torch-em's halo is per side, like blockpred's (a block reads block + 2 * halo),
  and it pads outside the volume with numpy's ``reflect`` (``_load_block``), the
  same as blockpred's default pad mode: with identical block and halo its
  output should equal blockpred's everywhere, border included (up to float
  rounding);
* MONAI blends overlapping windows (``constant`` mode: plain average), its
  windows start every 63 voxels (so the network's 2x pooling grid does not line
  up between windows), voxels near a window's edge see the network's zero
  'same' padding instead of real context, and it zero-pads (after
  normalisation) where the volume is smaller than the window: it is not
  expected to match, even in the interior.

torch-em import (torch-em 0.10.x): ``pip install --no-deps torch-em`` plus
``bioimage-cpp`` (``torch_em.util.prediction`` needs only numpy, torch, tqdm,
``bioimage_cpp`` for its blocking, and ``torch_em.transform.raw`` for the
default ``standardize`` preprocessing).  Its declared dependencies include
torchvision, and the only torchvision on the registry (0.29.x) pulls torch
2.15 with CUDA, replacing this venv's torch 2.13.0+cpu.  The package
``__init__`` files of ``torch_em``, ``torch_em.util`` and ``torch_em.transform``
import trainers, datasets, augmentations, kornia, elf, imageio, matplotlib,
tensorboard and torchvision, none of which prediction uses.  So
:func:`import_torch_em_prediction` registers those three packages in
``sys.modules`` as empty package modules whose ``__path__`` is the installed
directory (their ``__init__`` never runs; their submodules load from the real
files), and, only when torchvision is not installed, a ``torchvision`` stub
whose ``transforms`` attribute raises on any use: ``torch_em/transform/raw.py``
does ``from torchvision import transforms`` at import time but uses it only in
augmentation functions (``GaussianBlur``, ``get_default_mean_teacher_augmentations``),
never in ``standardize`` or prediction.  The stubs live in this process only.

MONAI: ``pip install monai`` (1.6.x needs only torch>=2.8 and numpy, so it keeps
torch 2.13.0+cpu).

    python bench/compare_peers.py [--shape 64,256,256] [--repeats 5] [--dir /tmp/blockpred-peers]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

import blockpred
from blockpred.config import parse_shape
from blockpred.demo import make_em_volume
from blockpred.io import create_volume, open_volume
from blockpred.models import build_preset, get_preset

PRESET = "tiny"
SCALE = np.float32(1.0 / 255.0)


def normalise(block: Any) -> np.ndarray:
    """uint8 -> float32 in [0, 1]: the same operations as blockpred's ``auto`` normalisation."""
    out = np.asarray(block).astype(np.float32)
    out *= SCALE
    return out


# --------------------------------------------------------------------------- torch-em import


class _Unavailable(types.ModuleType):
    """A stub module: any attribute use raises, naming why the stub is there."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(
            f"{self.__name__}.{name}: {self.__name__} is a stub from bench/compare_peers.py "
            "(torchvision is not installed; torch-em's prediction does not use it)"
        )


def import_torch_em_prediction() -> tuple[types.ModuleType, list[str]]:
    """``torch_em.util.prediction`` without running torch-em's package ``__init__`` files.

    Returns the module and a list of what was stubbed (see the module docstring).
    """
    spec = importlib.util.find_spec("torch_em")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("torch-em is not installed: pip install --no-deps torch-em bioimage-cpp")
    root = Path(list(spec.submodule_search_locations)[0])
    stubbed = []
    for name, directory in (("torch_em", root), ("torch_em.util", root / "util"),
                            ("torch_em.transform", root / "transform")):
        if name in sys.modules:
            continue
        package = types.ModuleType(name, f"{name} without its __init__ (bench/compare_peers.py)")
        package.__path__ = [str(directory)]
        package.__package__ = name
        package.__file__ = None
        sys.modules[name] = package
        stubbed.append(f"{name} (package __init__ skipped)")
    if importlib.util.find_spec("torchvision") is None and "torchvision" not in sys.modules:
        torchvision = _Unavailable("torchvision")
        transforms = _Unavailable("torchvision.transforms")
        torchvision.__dict__["transforms"] = transforms
        sys.modules["torchvision"] = torchvision
        sys.modules["torchvision.transforms"] = transforms
        stubbed.append("torchvision, torchvision.transforms (raising stubs)")
    import torch_em.util.prediction as prediction

    return prediction, stubbed


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# --------------------------------------------------------------------------- the runs


def weights_digest(net: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(net.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def create_output_like(path: str, reference_path: str, shape: tuple[int, ...]):
    """A zarr v3 float32 array with the chunks and codecs of blockpred's output array."""
    import zarr

    reference = zarr.open_array(reference_path, mode="r")
    return zarr.create_array(
        store=path, shape=shape, dtype="float32", chunks=reference.chunks,
        compressors=reference.compressors, fill_value=0.0, overwrite=True,
    )


def blockpred_array_path(output: str) -> str:
    """The array inside blockpred's OME-Zarr output (``<output>/0``) or the output itself."""
    import zarr

    node = zarr.open(output, mode="r")
    return output if isinstance(node, zarr.Array) else str(Path(output) / "0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="64,256,256", help="volume shape z,y,x (default 64,256,256)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds; medians are reported (default 5)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--margin", type=int, default=None, help="interior margin for max |diff| (default: the halo)")
    parser.add_argument("--dir", default="/tmp/blockpred-peers")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    shape = tuple(parse_shape(args.shape, "shape"))
    preset = get_preset(PRESET)
    block, halo = tuple(preset.default_block), tuple(preset.default_halo)
    window = tuple(b + 2 * h for b, h in zip(block, halo))  # blockpred's network input shape
    margin = args.margin if args.margin is not None else max(halo)
    num_voxels = int(np.prod(shape))
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)

    print(f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    print(f"monai {version('monai')}, torch-em {version('torch-em')}, bioimage-cpp {version('bioimage-cpp')}, "
          f"blockpred {version('blockpred')}", flush=True)

    # --- the volume
    source = str(root / "raw.zarr")
    start = time.perf_counter()
    volume = create_volume(source, spatial_shape=shape, num_channels=None, dtype="uint8",
                           chunk_shape=(64, 64, 64), ome=False, overwrite=True)
    volume.write(volume.box, make_em_volume(shape))
    volume.close()
    print(f"volume {shape} uint8 ({num_voxels / 1e6:.2f} Mvox), zarr chunks 64^3: {source} "
          f"({time.perf_counter() - start:.1f} s to make)", flush=True)

    # --- the network: one module object for every tool
    net = build_preset(PRESET)
    digest = weights_digest(net)
    print(f"network {PRESET!r}: block {block}, halo {halo} per side, window {window}, weights {digest}", flush=True)

    # --- peers
    prediction, stubbed = import_torch_em_prediction()
    print(f"torch_em.util.prediction imported; stubbed: {', '.join(stubbed) or 'nothing'}", flush=True)
    from monai.inferers import sliding_window_inference
    import zarr

    has_pipelined = hasattr(prediction, "predict_with_halo_pipelined")

    # Warm-up: one untimed forward pass of the network input shape (oneDNN primitive creation).
    with torch.no_grad():
        net(torch.zeros((1, 1) + window))

    outputs: dict[str, np.ndarray] = {}
    times: dict[str, list[tuple[float, float]]] = {}
    notes: dict[str, str] = {}
    out_shape = (net.out_channels if hasattr(net, "out_channels") else 2,) + shape

    def run_blockpred(key: str, options: dict) -> tuple[float, float, Callable[[], np.ndarray]]:
        output = str(root / f"{key}.zarr")
        start = time.perf_counter()
        summary = blockpred.predict(source, output, model=net, block=block, halo=halo, progress=False,
                                    overwrite=True, device="cpu", **options)
        wall = time.perf_counter() - start

        def result() -> np.ndarray:
            v = open_volume(summary.output)
            try:
                return np.asarray(v.read(v.box))
            finally:
                v.close()

        return summary.stats.seconds, wall, result

    def run_torch_em(key: str, function: Callable) -> tuple[float, float, Callable[[], np.ndarray]]:
        reference = blockpred_array_path(str(root / "blockpred-local.zarr"))
        output = create_output_like(str(root / f"{key}.zarr"), reference, out_shape)
        input_ = zarr.open_array(source, mode="r")
        start = time.perf_counter()
        function(input_, net, gpu_ids=["cpu"], block_shape=block, halo=halo, output=output,
                 preprocess=normalise, disable_tqdm=True)
        seconds = time.perf_counter() - start
        return seconds, seconds, lambda: np.asarray(zarr.open_array(str(root / f"{key}.zarr"), mode="r")[...])

    def run_monai(key: str) -> tuple[float, float, Callable[[], np.ndarray]]:
        start = time.perf_counter()
        data = normalise(zarr.open_array(source, mode="r")[...])
        tensor = torch.from_numpy(data)[None, None]
        loaded = time.perf_counter()
        with torch.no_grad():
            result = sliding_window_inference(tensor, roi_size=window, sw_batch_size=1, predictor=net,
                                              overlap=0.25, mode="constant")
        end = time.perf_counter()
        array = np.asarray(result[0].numpy())
        return end - loaded, end - start, lambda: array

    def run_network(count: int) -> tuple[float, float, None]:
        """The compute floor: ``count`` forward passes of one window (blockpred's block count), no I/O."""
        inp = torch.rand((1, 1) + window, generator=torch.Generator().manual_seed(0))
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(count):
                net(inp)
        seconds = time.perf_counter() - start
        return seconds, seconds, None

    tools: list[tuple[str, str, Callable[[], tuple[float, float, Callable[[], np.ndarray] | None]]]] = [
        ("blockpred-local", "blockpred (local)", lambda: run_blockpred("blockpred-local", {"local": True})),
        ("blockpred-dask", "blockpred (dask, 1 worker)", lambda: run_blockpred("blockpred-dask", {"workers": 1})),
        ("torch-em-halo", "torch-em predict_with_halo",
         lambda: run_torch_em("torch-em-halo", prediction.predict_with_halo)),
    ]
    if has_pipelined:
        tools.append(("torch-em-pipelined", "torch-em predict_with_halo_pipelined",
                      lambda: run_torch_em("torch-em-pipelined", prediction.predict_with_halo_pipelined)))
    tools.append(("monai", "MONAI sliding_window_inference", lambda: run_monai("monai")))
    num_blocks = int(np.prod([-(-n // b) for n, b in zip(shape, block)]))
    tools.append(("network", f"network alone ({num_blocks} x forward {window[0]}^3)",
                  lambda: run_network(num_blocks)))

    for repeat in range(args.repeats):
        for key, label, run in tools:
            seconds, wall, result = run()
            times.setdefault(key, []).append((seconds, wall))
            if repeat == 0 and result is not None:
                outputs[key] = result()
            print(f"round {repeat + 1}/{args.repeats}  {label:38s} {seconds:7.2f} s  (wall {wall:6.2f} s)", flush=True)

    assert weights_digest(net) == digest, "a tool changed the network's weights"

    # --- agreement
    reference = outputs["blockpred-local"]
    interior = tuple(slice(margin, max(margin, n - margin)) for n in shape)
    agreement = {}
    for key, array in outputs.items():
        if array.shape != reference.shape:
            agreement[key] = {"shape": list(array.shape)}
            continue
        diff = np.abs(array.astype(np.float64) - reference.astype(np.float64))
        inner = diff[(slice(None),) + interior]
        agreement[key] = {
            "max_all": float(diff.max()), "max_interior": float(inner.max()) if inner.size else float("nan"),
            "mean_interior": float(inner.mean()) if inner.size else float("nan"),
        }
        if key != "blockpred-local" and diff.max() > 0:
            where = np.unravel_index(int(np.argmax(diff)), diff.shape)
            agreement[key]["argmax"] = [int(i) for i in where]

    notes["blockpred-local"] = "seconds = pipeline (read, normalise, pad, predict, crop, write zarr); wall adds setup"
    notes["blockpred-dask"] = "seconds = pipeline; wall adds cluster start, worker model load"
    notes["torch-em-halo"] = ("zarr in -> zarr out (same chunks/codecs as blockpred's), 1 thread pool worker; "
                              "halo per side, reflect pad")
    notes["torch-em-pipelined"] = "zarr in -> zarr out; defaults: 4 prefetch threads, 1 writer, batch 1"
    notes["monai"] = (f"whole volume in memory as a torch tensor (input and output); seconds = the call, wall adds "
                      f"zarr read + normalise; output not written; roi {window}, overlap 0.25, constant blend")

    notes["network"] = ("compute floor: the network on one random window, as many times as blockpred has blocks; "
                        "no reading, padding, normalising, blending or writing")

    base = statistics.median(t[0] for t in times["blockpred-local"])
    rows = []
    for key, label, _ in tools:
        seconds = statistics.median(t[0] for t in times[key])
        wall = statistics.median(t[1] for t in times[key])
        a = agreement.get(key, {})
        rows.append({
            "key": key, "tool": label, "seconds": seconds, "wall_s": wall,
            "mvox_per_s": num_voxels / seconds / 1e6, "ratio_vs_blockpred_local": seconds / base,
            "max_abs_diff_all": a.get("max_all"), "max_abs_diff_interior": a.get("max_interior"),
            "mean_abs_diff_interior": a.get("mean_interior"), "argmax_diff": a.get("argmax"),
            "notes": notes.get(key, ""), "runs": times[key],
        })

    print()
    print(f"volume {shape} = {num_voxels / 1e6:.2f} Mvox, block {block}, halo {halo}, {PRESET!r}, "
          f"{args.repeats} rounds (medians), torch threads {args.threads}; interior = {margin} voxels from every face")
    print()
    print("| tool | seconds | wall s | Mvox/s | time / blockpred local | max abs diff (all) | "
          "max abs diff (interior) | notes |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        diff_all = diff_in = "n/a"
        if r["key"] == "blockpred-local":
            diff_all = diff_in = "reference"
        elif r["max_abs_diff_all"] is not None:
            diff_all, diff_in = f"{r['max_abs_diff_all']:.2e}", f"{r['max_abs_diff_interior']:.2e}"
        print(f"| {r['tool']} | {r['seconds']:.2f} | {r['wall_s']:.2f} | {r['mvox_per_s']:.2f} | "
              f"{r['ratio_vs_blockpred_local']:.2f} | {diff_all} | {diff_in} | {r['notes']} |")
    ranges = ", ".join(f"channel {c} {reference[c].min():.4f}..{reference[c].max():.4f} (std {reference[c].std():.4f})"
                       for c in range(reference.shape[0]))
    print(f"  blockpred's output values (the scale of the diffs): {ranges}")
    for r in rows:
        if r["argmax_diff"] is not None:
            print(f"  {r['tool']}: largest |diff| at (c, z, y, x) = {tuple(r['argmax_diff'])}, "
                  f"mean |diff| in the interior {r['mean_abs_diff_interior']:.2e}")

    if args.json:
        report = {
            "shape": list(shape), "block": list(block), "halo": list(halo), "window": list(window),
            "model": PRESET, "weights": digest, "repeats": args.repeats, "threads": args.threads,
            "margin": margin, "torch": torch.__version__, "monai": version("monai"),
            "torch_em": version("torch-em"), "bioimage_cpp": version("bioimage-cpp"),
            "torch_em_stubs": stubbed, "rows": rows,
            "reference_range": [[float(reference[c].min()), float(reference[c].max())]
                                for c in range(reference.shape[0])],
        }
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
