"""Peer benchmark: plane-by-plane prediction with bioimage.io's own library.

Measures how fast bioimageio.core predicts single 2D planes with a local
bioimage.io model package, as a reference for blockpred's plane-by-plane path.
Each z-plane of a (z, y, x) volume becomes its own bioimageio.core Sample
(axes as the package declares them, e.g. batch=1, channel=1, y, x) and goes
through the library's standard route: one `create_prediction_pipeline` (weights
loaded once), then `predict_sample_without_blocking` per plane -- what
`bioimageio.core.predict(model=pipeline, inputs=...)` does internally, with the
package's own pre- and postprocessing. `--route predict` calls
`bioimageio.core.predict` itself instead (it loads/unloads weights per call).

bioimageio.core 0.11 semantics worth knowing when comparing outputs:
  * the plane is first padded by the output halo (numpy/xarray mode
    "symmetric", or the input's `pad` spec), run, and the halo cropped again;
    `--skip-halo-padding` turns that off (what `bioimageio.core.test_model` does);
  * zero_mean_unit_variance with `axes` listed (no "batch") uses per-sample
    statistics: mean/std (ddof=0) over those axes of the *padded* plane,
    out = (x - mean) / (std + 1e-6); with `axes` unset it uses running dataset
    statistics accumulated over all planes seen so far (order dependent).

Output (--save OUT.npy): predictions of the first output tensor, one per plane
in z order, stacked to (z, *output axes without batch), e.g. (z, c, y, x);
the JSON result names these axes in "saved_axes". Predictions of the first
timed repeat are saved.

Setup (own venv; never install into blockpred's):
    python3.11 -m venv /work/peers-venv
    /work/peers-venv/bin/pip install torch==2.13.0      # CPU wheel first
    /work/peers-venv/bin/pip install bioimageio.core "pydantic<2.13"
    (bioimageio.spec 0.5.12.0 fails to load packages under pydantic 2.14)
Run:
    /work/peers-venv/bin/python bench/bioimageio_peer.py --package PKG_DIR \
        --volume vol.npy --repeats 3 [--save pred.npy] [--threads N]
Prints one JSON object on stdout.
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import bioimageio.core
from bioimageio.core import create_prediction_pipeline, predict
from bioimageio.core.digest_spec import create_sample_for_model
from bioimageio.core.tensor import Tensor
from bioimageio.spec import load_model_description


def plane_tensor(plane, axes):
    """(y, x) array -> Tensor in the input's axis order, other axes of size 1."""
    dims = [a.id for a in axes]
    if sorted(str(d) for d in dims if d not in ("batch", "channel")) != ["x", "y"]:
        raise SystemExit(f"need a 2D input (batch/channel/y/x axes), got {dims}")
    return Tensor(plane, dims=("y", "x")).transpose(dims, missing_dims="expand")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--package", required=True, help="package folder or its rdf.yaml")
    ap.add_argument("--volume", required=True, help=".npy volume (z, y, x), float32 or uint8")
    ap.add_argument("--repeats", type=int, default=1, help="timed passes over all planes")
    ap.add_argument("--save", help="save predictions of the first timed pass here (.npy)")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads")
    ap.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    ap.add_argument("--weights-format", help="e.g. torchscript (default: library's choice)")
    ap.add_argument("--skip-halo-padding", action="store_true",
                    help="no halo padding/cropping (test_model semantics)")
    ap.add_argument("--route", choices=["pipeline", "predict"], default="pipeline")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    src = Path(args.package)
    src = src / "rdf.yaml" if src.is_dir() else src
    model = load_model_description(src, perform_io_checks=False)  # offline, no hashing
    vol = np.load(args.volume)
    if vol.ndim != 3:
        raise SystemExit(f"expected a (z, y, x) volume, got shape {vol.shape}")
    axes = model.inputs[0].axes
    out_id = model.outputs[0].id
    pp = create_prediction_pipeline(
        model, devices=[args.device], weights_format=args.weights_format
    )
    skip = args.skip_halo_padding

    def run(plane):
        sample = create_sample_for_model(model, inputs=plane_tensor(plane, axes))
        if args.route == "predict":  # loads + unloads the weights each call
            out = predict(model=pp, inputs=sample)
        else:
            out = pp.predict_sample_without_blocking(
                sample, skip_input_padding=skip, skip_output_cropping=skip
            )
        return out.members[out_id]

    pp.load()
    try:
        run(vol[0])  # warm-up plane
        saved = []
        t0 = time.perf_counter()
        for r in range(args.repeats):
            for z in range(vol.shape[0]):
                t = run(vol[z])
                if args.save and r == 0:
                    saved.append(t)
        seconds = time.perf_counter() - t0
    finally:
        if args.route == "pipeline":
            pp.unload()

    planes = args.repeats * vol.shape[0]
    result = {
        "planes": planes,
        "seconds": round(seconds, 4),
        "planes_per_s": round(planes / seconds, 3),
        "mvox_per_s": round(planes * vol.shape[1] * vol.shape[2] / seconds / 1e6, 3),
        "bioimageio_core": bioimageio.core.__version__,
        "torch_threads": torch.get_num_threads(),
        "model": model.name,
        "volume_shape": list(vol.shape),
        "volume_dtype": str(vol.dtype),
        "route": args.route,
        "halo_padding": not skip,
    }
    if args.save:
        dims = [d for d in saved[0].dims if d != "batch"]
        arrs = [t.data.squeeze("batch", drop=True).transpose(*dims).values
                if "batch" in t.dims else t.data.values for t in saved]
        np.save(args.save, np.stack(arrs))
        result["saved"] = args.save
        result["saved_axes"] = ["z", *map(str, dims)]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
