"""The peers of ``bench/compare_peers.py``: MONAI's sliding window and torch-em's ``predict_with_halo``.

Used two ways:

* in-process by ``compare_peers.py`` (the network built once, a warm-up pass
  untimed: the peers' steady state, no start-up counted);
* as the script a user of the peer writes and runs, one process per run::

      python bench/peers.py monai|torch-em-pipelined|torch-em-halo tiny|unet12 SOURCE OUT --like BLOCKPRED_OUT
                            [--dir ROOT] [--threads 2]

  It imports torch and the peer, builds or loads the network, reads the zarr
  volume, predicts with block 64^3 and the network's halo, and writes a zarr
  array with the chunks and codecs of blockpred's output (``--like``); its
  parent times it from start to exit, as ``blockpred run`` is timed.  MONAI
  needs the whole volume in memory and writes its result after it.

Its top-level imports are numpy and torch only, as a peer user's script has.
torch-em is imported without its package ``__init__`` files (see
:func:`import_torch_em_prediction`).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

SCALE = np.float32(1.0 / 255.0)
PEER_BLOCK = (64, 64, 64)
PEERS = ("monai", "torch-em-pipelined", "torch-em-halo")
#: The 3D TorchScript files of ``tests/scripted.py`` (made with torch.jit.script, torch-em's with trace).
SCRIPTED = ("loop-list", "monai-basicunet", "monai-unet", "torch-em-unet3d")


def normalise(block: Any) -> np.ndarray:
    """uint8 -> float32 in [0, 1]: the same operations as blockpred's ``auto`` normalisation."""
    out = np.asarray(block).astype(np.float32)
    out *= SCALE
    return out


class _Unavailable(types.ModuleType):
    """A stub module: any attribute use raises, naming why the stub is there."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(
            f"{self.__name__}.{name}: {self.__name__} is a stub from bench/peers.py "
            "(torchvision is not installed; torch-em's prediction does not use it)"
        )


def import_torch_em_prediction() -> tuple[types.ModuleType, list[str]]:
    """``torch_em.util.prediction`` without running torch-em's package ``__init__`` files.

    torch-em 0.10.x: ``torch_em.util.prediction`` needs only numpy, torch,
    tqdm, ``bioimage_cpp`` and ``torch_em.transform.raw``.  The package
    ``__init__`` files of ``torch_em``, ``torch_em.util`` and
    ``torch_em.transform`` import trainers, datasets, kornia, elf, matplotlib,
    tensorboard and torchvision, none of which prediction uses (and the only
    torchvision on the registry pulls a CUDA torch).  So those three packages
    are registered in ``sys.modules`` as empty package modules whose
    ``__path__`` is the installed directory, and, only when torchvision is not
    installed, a ``torchvision`` stub that raises on any use.  Returns the
    module and a list of what was stubbed.
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
        package = types.ModuleType(name, f"{name} without its __init__ (bench/peers.py)")
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


def make_network(name: str, root: Path) -> tuple[torch.nn.Module, list[str], tuple[int, int, int]]:
    """The module the peers run, blockpred's model options for the same weights, and the halo.

    ``tiny``: blockpred's preset (4 features, depth 1, seeded weights), halo 10.
    ``unet12``: a user's TorchScript file (UNet3d, 12 features, depth 3, 1 -> 2 channels,
    sigmoid; saved under ``root`` on first use), halo 16.  The :data:`SCRIPTED` networks: the TorchScript
    files of ``tests/scripted.py``, saved under ``root``, halo 16.
    """
    if name == "tiny":
        from blockpred.models.presets import build_preset

        return build_preset("tiny"), ["--model", "tiny"], (10, 10, 10)
    if name == "unet12":
        path = root / "unet12.pt"
        if not path.exists():
            from blockpred.models.unet import UNet3d

            torch.manual_seed(0)
            net = UNet3d(in_channels=1, out_channels=2, depth=3, initial_features=12).eval()
            torch.jit.script(net).save(str(path))
        return torch.jit.load(str(path)).eval(), ["--model", str(path), "--halo", "16,16,16"], (16, 16, 16)
    if name in SCRIPTED:  # TorchScript files as their users save them (tests/scripted.py)
        checkout = str(Path(__file__).resolve().parents[1])
        if checkout not in sys.path:
            sys.path.insert(0, checkout)
        from tests import scripted

        path = scripted.save(name, root)
        halo = scripted.HALOS[name]
        return torch.jit.load(str(path)).eval(), ["--model", str(path), "--halo", ",".join(map(str, halo))], halo
    raise SystemExit(f"unknown network {name!r}: use tiny, unet12 or one of {', '.join(SCRIPTED)}")


def window(halo: tuple[int, int, int]) -> tuple[int, ...]:
    """The peers' network input: block 64^3 plus the halo on each side."""
    return tuple(b + 2 * h for b, h in zip(PEER_BLOCK, halo))


def like_array(like: str) -> Any:
    """blockpred's output array (a zarr array, or the scale ``0`` of its OME-Zarr group)."""
    import zarr

    root = Path(like)
    return zarr.open_array(str(root / "0") if (root / "0").exists() else like, mode="r")


def create_output(path: str, shape: tuple[int, ...], like: str) -> Any:
    """A float32 zarr array of ``shape`` with the chunks and codecs of blockpred's output ``like``."""
    import zarr

    reference = like_array(like)
    return zarr.create_array(store=path, shape=shape, dtype="float32", chunks=reference.chunks,
                             compressors=reference.compressors, fill_value=0.0, overwrite=True)


def run_torch_em(function: Any, source: str, net: torch.nn.Module, halo: tuple[int, int, int],
                 output: Any) -> float:
    """torch-em's ``function`` over the zarr volume ``source`` into the zarr array ``output``: seconds."""
    import zarr

    start = time.perf_counter()
    function(zarr.open_array(source, mode="r"), net, gpu_ids=["cpu"], block_shape=PEER_BLOCK, halo=halo,
             output=output, preprocess=normalise, disable_tqdm=True)
    return time.perf_counter() - start


def run_monai(source: str, net: torch.nn.Module, halo: tuple[int, int, int]) -> tuple[float, np.ndarray]:
    """MONAI's ``sliding_window_inference`` at its defaults (overlap 0.25, blend constant), ``roi_size`` =
    block + 2 x halo, ``sw_batch_size`` 1, from reading the volume to the result in memory: (seconds, result)."""
    import zarr
    from monai.inferers import sliding_window_inference

    start = time.perf_counter()
    tensor = torch.from_numpy(normalise(zarr.open_array(source, mode="r")[...]))[None, None]
    with torch.no_grad():
        result = sliding_window_inference(tensor, roi_size=window(halo), sw_batch_size=1, predictor=net,
                                          overlap=0.25, mode="constant")
    return time.perf_counter() - start, result[0].numpy()


def main(argv: list[str] | None = None) -> None:
    """The script a peer's user runs: one prediction, its output written to zarr."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("peer", choices=PEERS)
    parser.add_argument("network", choices=("tiny", "unet12") + SCRIPTED)
    parser.add_argument("source", help="the input zarr array")
    parser.add_argument("out", help="the output zarr array (replaced)")
    parser.add_argument("--like", required=True, help="blockpred's output of the same run: its chunks and codecs")
    parser.add_argument("--dir", default="/tmp/blockpred-peers", help="where unet12.pt is")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    net, _, halo = make_network(args.network, Path(args.dir))
    import zarr

    shape = zarr.open_array(args.source, mode="r").shape
    out_channels = like_array(args.like).shape[0]
    output = create_output(args.out, (out_channels, *shape), args.like)
    if args.peer == "monai":
        _, result = run_monai(args.source, net, halo)
        output[...] = result
    else:
        prediction, _ = import_torch_em_prediction()
        function = (prediction.predict_with_halo_pipelined if args.peer == "torch-em-pipelined"
                    else prediction.predict_with_halo)
        run_torch_em(function, args.source, net, halo, output)


if __name__ == "__main__":
    main()
