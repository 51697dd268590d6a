"""The peers on one GPU, on the same network and volume as ``blockpred run`` (issue 37).

Run by ``bench/gpu_campaign.py`` in a process of its own; prints one JSON line per peer:

* ``torch-em predict_with_halo_pipelined`` (``gpu_ids=[0]``), the zarr volume read lazily, the
  output written into a zarr array with blockpred's output chunks and codecs;
* ``MONAI sliding_window_inference`` at its defaults (overlap 0.25, blend ``constant``), the volume
  read into memory, windows on the GPU (``sw_device`` cuda), the result stitched on the GPU and then
  written into such a zarr array.

Both get blockpred's block and halo (what a user of those tools would have to find by hand), the
network built once and moved to the GPU, and an untimed warm-up pass (cuDNN's autotuning), so each
time is the peer's steady state: no interpreter start, no import, no model load, all of which
``blockpred run``'s wall time includes.  ``fp32`` is each peer's default; ``bf16`` wraps the
network in ``torch.autocast`` (what a user who knows to ask for it would do).  The max |diff| against
blockpred's output is taken over a central crop.

Issue 47: each line also gives ``script_s``, the seconds from this script's first line (imports, the
network built, the warm-up included) to the peer's end: run with one peer per process, that and the
process's wall time are the peer's whole script, beside its in-process ``seconds``.  With
``--reference`` (blockpred's fp32 prediction of the same region) each peer's output, and blockpred's
(``blockpred:auto`` in ``--peers``: no run, the ``like`` output compared), is compared with it over
the central crop, as shares of the reference's range (``vs_fp32_max``, ``vs_fp32_mean``).  A blockpred
output is compared only where its run finished (every block marked done); else the line says so.
"""

from __future__ import annotations

import time

_SCRIPT_START = time.time()  # before the imports: a whole script's start-up includes them

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import create_output, import_torch_em_prediction, like_array, normalise  # noqa: E402


class Autocast(torch.nn.Module):
    """The network under ``torch.autocast`` at ``dtype``, its output cast back to float32."""

    def __init__(self, net: torch.nn.Module, dtype: torch.dtype, device_type: str):
        super().__init__()
        self.net, self.dtype, self.device_type = net, dtype, device_type
        self.out_channels = getattr(net, "out_channels", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.net(x).float()


def central_crop(shape: tuple[int, ...], size: tuple[int, int, int]) -> tuple[slice, ...]:
    """A crop of ``size`` around the centre of the spatial ``shape``."""
    return tuple(slice(max(0, s // 2 - c // 2), min(s, s // 2 - c // 2 + c)) for s, c in zip(shape, size))


def unfinished(path: str) -> str:
    """Why the blockpred output at ``path`` is no reference ("" where its run finished: every block done)."""
    from blockpred.io import parse_volume_path
    from blockpred.pipeline.markers import DoneMarkers, markers_path

    markers = DoneMarkers.open(markers_path(parse_volume_path(path)))
    if markers is None:
        return f"{path} has no blockpred markers"
    done, blocks = markers.num_finished(), int(markers.grid_shape.prod())
    return "" if done == blocks else f"{path}: its run finished {done} of {blocks} blocks"


def against(got: np.ndarray, reference: np.ndarray | None) -> dict:
    """``got`` against the fp32 reference, as shares of its range (nothing without one)."""
    if reference is None:
        return {}
    from blockpred.tuning.precision import differences

    largest, mean = differences(got, reference)
    return {"vs_fp32_max": largest, "vs_fp32_mean": mean}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="the input zarr array (uint8)")
    parser.add_argument("like", help="blockpred's output of the same region: chunks, codecs, and the diff")
    parser.add_argument("--model", default="cremi2018", help="a blockpred preset")
    parser.add_argument("--block", required=True, help="Z,Y,X")
    parser.add_argument("--halo", required=True, help="Z,Y,X")
    parser.add_argument("--depth", type=int, required=True, help="predict z in [0, depth)")
    parser.add_argument("--peers", default="torch-em:bf16,monai:bf16,torch-em:fp32,monai:fp32")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    parser.add_argument("--dir", default="/tmp/blockpred-gpu-peers")
    parser.add_argument("--deadline", type=float, default=None, help="time.time() after which no peer starts")
    parser.add_argument("--reference", default=None, help="blockpred's fp32 output of the region, finished")
    args = parser.parse_args()
    import zarr

    from blockpred.models.presets import build_preset

    block = tuple(int(v) for v in args.block.split(","))
    halo = tuple(int(v) for v in args.halo.split(","))
    source = zarr.open_array(args.source, mode="r")
    shape = (args.depth, *source.shape[1:])
    out_channels = like_array(args.like).shape[0]
    device = torch.device(args.device)
    net = build_preset(args.model).eval().to(device)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    crop = central_crop(shape, (min(32, shape[0]), 512, 512))
    why = unfinished(args.like)
    if why:  # an output emptied or cut short by a stopped run is no yardstick
        print(json.dumps({"like": args.like, "not_compared": why}), flush=True)
    reference = None if why else np.asarray(like_array(args.like)[(slice(None), *crop)])
    fp32 = None
    if args.reference is not None:
        why_not = unfinished(args.reference)
        if why_not:
            print(json.dumps({"reference": args.reference, "not_compared": why_not}), flush=True)
        else:
            fp32 = np.asarray(like_array(args.reference)[(slice(None), *crop)])
    if "blockpred:auto" in args.peers.split(",") and reference is not None:
        print(json.dumps({"peer": "blockpred", "precision": "auto", **against(reference, fp32)}), flush=True)
    prediction = import_torch_em_prediction()[0] if "torch-em" in args.peers else None
    for item in args.peers.split(","):
        peer, precision = item.split(":")
        if peer == "blockpred":
            continue
        if args.deadline is not None and time.time() > args.deadline:
            print(json.dumps({"peer": peer, "precision": precision, "skipped": "deadline"}), flush=True)
            continue
        model = net if precision == "fp32" else Autocast(net, torch.bfloat16, device.type)
        model.out_channels = out_channels
        window = tuple(b + 2 * h for b, h in zip(block, halo))
        with torch.no_grad():  # warm-up: cuDNN picks its algorithms for this shape
            model(torch.rand((1, 1, *window), device=device))
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        output = create_output(str(Path(args.dir) / f"{peer}-{precision}.zarr"), (out_channels, *shape), args.like)
        start = time.perf_counter()
        if peer == "torch-em":
            with torch.no_grad():
                prediction.predict_with_halo_pipelined(
                    source, model, gpu_ids=[0 if device.type == "cuda" else "cpu"], block_shape=block, halo=halo, output=output,
                    preprocess=normalise, disable_tqdm=True, roi=(slice(0, args.depth), slice(None), slice(None)))
        elif peer == "monai":
            from monai.inferers import sliding_window_inference

            volume = torch.from_numpy(normalise(source[: args.depth]))[None, None]
            with torch.no_grad():
                result = sliding_window_inference(volume, roi_size=window, sw_batch_size=1, predictor=model,
                                                  overlap=0.25, mode="constant", sw_device=device, device=device)
            output[...] = result[0].cpu().numpy()
            del result, volume
        else:
            raise SystemExit(f"unknown peer {peer!r}")
        seconds = time.perf_counter() - start
        got = np.asarray(output[(slice(None), *crop)])
        print(json.dumps({
            "peer": peer, "precision": precision, "seconds": round(seconds, 3),
            "mvox_per_s": round(int(np.prod(shape)) / seconds / 1e6, 2), "voxels": int(np.prod(shape)),
            "block": block, "halo": halo, "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
            "max_diff_central": float(np.abs(got - reference).max()) if reference is not None else None,
            "script_s": round(time.time() - _SCRIPT_START, 2), **against(got, fp32),
        }), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
