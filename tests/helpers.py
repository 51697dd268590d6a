"""Plain helpers shared by the tests (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zarr
from zarr.storage import LocalStore

from blockpred.io import create_volume, open_volume, parse_volume_path

from tests.ci import REALDATA, ROOT  # noqa: F401 - the tests import them from here too


def child_env(*first: str | Path) -> dict[str, str]:
    """The environment for a child Python: ``first`` (default: the repository) ahead of this one's ``PYTHONPATH``.

    Replacing ``PYTHONPATH`` would hide packages installed with ``pip install
    --target`` and found through it (as on the GPU machine, where every child
    of these tests then failed to import zarr or dask).
    """
    entries = [str(path) for path in (first or (ROOT,))]
    entries += [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(entries))


def write_test_volume(
    path: str | Path,
    data: np.ndarray,
    chunks=None,
    zarr_format: int = 3,
    *,
    voxel_size=None,
) -> str:
    """Write ``data`` as a plain volume (no OME-NGFF group) at ``path``; return the path.

    (z, y, x) and (c, z, y, x) data go through :func:`create_volume` and work
    for zarr (``vol.zarr[/name]``), N5 (``vol.n5/name``) and HDF5
    (``file.h5:/name``).  Data of any other rank (to test that it is refused)
    can only be written to zarr.  ``chunks`` is spatial (z, y, x), default up
    to 64 per axis; ``zarr_format`` is used for zarr only.
    """
    vpath = parse_volume_path(path)
    if data.ndim not in (3, 4):
        if vpath.format != "zarr":
            raise ValueError(f"only zarr test volumes may have {data.ndim} axes, got {path!r}")
        array = zarr.create_array(
            LocalStore(vpath.container),
            name=vpath.dataset,
            shape=data.shape,
            chunks=data.shape if chunks is None else tuple(chunks),
            dtype=data.dtype,
            zarr_format=zarr_format,
        )
        array[...] = data
        return str(path)
    spatial_shape = data.shape[-3:]
    chunk_shape = tuple(min(s, 64) for s in spatial_shape) if chunks is None else tuple(chunks)[-3:]
    with create_volume(
        path,
        spatial_shape=spatial_shape,
        num_channels=data.shape[0] if data.ndim == 4 else None,
        dtype=data.dtype,
        chunk_shape=chunk_shape,
        voxel_size=voxel_size,
        ome=False,
        zarr_format=zarr_format if vpath.format == "zarr" else None,
    ) as volume:
        volume.write(volume.box, data)
    return str(path)


def read_volume(path: str | Path) -> np.ndarray:
    """A volume's whole contents (channels first where it has them)."""
    with open_volume(str(path)) as volume:
        return volume.read(volume.box)


def run_blockpred(*args: str, cwd: str | Path | None = None, env: dict | None = None,
                  timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m blockpred ARGS`` as a real child process (text output); never raises on its exit code."""

    return subprocess.run([sys.executable, "-m", "blockpred", *map(str, args)], cwd=cwd, env=env or child_env(),
                          capture_output=True, text=True, timeout=timeout)


#: How long a test waits for what takes seconds before it calls it a hang.  Far beyond any wait on a loaded machine,
#: it decides nothing about speed: it only turns a hang into a failure that names what was awaited.
HANG_S = 300.0


def wait_for(condition, what: str, *, process: subprocess.Popen | None = None, limit_s: float = HANG_S,
             poll_s: float = 0.05):
    """Poll ``condition()`` until it is truthy, and return that value.  Fails where ``process`` ended first (with
    the end of its stderr), and, as a hang, after ``limit_s`` (see :data:`HANG_S`): no timing is asserted."""
    import pytest

    deadline = time.monotonic() + limit_s
    while True:
        value = condition()
        if value:
            return value
        if process is not None and process.poll() is not None:
            err = process.communicate()[1] if process.stderr is not None else ""
            err = err.decode(errors="replace") if isinstance(err, bytes) else (err or "")
            pytest.fail(f"the process ended (exit {process.returncode}) before {what}: {err[-3000:]}", pytrace=False)
        if time.monotonic() > deadline:
            pytest.fail(f"hung: no {what} after {limit_s:g} s", pytrace=False)
        time.sleep(poll_s)


def done_blocks(output: str | Path) -> set:
    """The blocks an output's markers call finished (written, or skipped as empty): what a resume leaves out."""
    from blockpred.pipeline.markers import DoneMarkers, markers_path

    markers = DoneMarkers.open(markers_path(parse_volume_path(str(output))))
    return set() if markers is None else markers.finished_indices()


def assert_resumed(said: str, output: str | Path, clean, *, num_blocks: int, done_before: int,
                   atol: float = 0.0) -> None:
    """A resume of ``output`` ran exactly the blocks the markers left to do, and finished it as a clean run does.

    ``said``: the resume's summary line (``predicted ... in N blocks (M already done) ...``), which must count
    ``num_blocks - done_before`` blocks predicted and ``done_before`` already done; every block is marked done
    afterwards; the output equals ``clean`` (a clean run's output path, or its data), bit for bit or within
    ``atol`` (runs in other processes, or on dask workers, round the last bit their own way).
    """
    import re

    found = re.search(r"in (\d+) blocks(?: \(([^)]*)\))? in ", said)
    assert found is not None, f"no summary line in: {said}"
    resumed = re.search(r"(\d+) already done", found.group(2) or "")
    assert (int(found.group(1)), int(resumed.group(1)) if resumed else 0) == (num_blocks - done_before, done_before), \
        f"expected {num_blocks - done_before} blocks predicted and {done_before} already done: {found.group(0)}"
    assert len(done_blocks(output)) == num_blocks, "a block is not marked done after the resume"
    expected = read_volume(clean) if isinstance(clean, (str, Path)) else clean
    if atol:
        np.testing.assert_allclose(read_volume(output), expected, rtol=0, atol=atol)
    else:
        np.testing.assert_array_equal(read_volume(output), expected)


def error_line(stderr: str) -> str:
    """The one ``blockpred: error:`` line of ``stderr``; fails when there is none, several, or a traceback."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("blockpred: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def snapshot(root: str | Path) -> dict:
    """Every file under ``root`` with its bytes: equal snapshots mean nothing was written, deleted or changed."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                out[os.path.relpath(path, root)] = Path(path).read_bytes()
    return out


def assert_refused(result: subprocess.CompletedProcess, *expected: str) -> None:
    """Exit 2 and stderr exactly one ``blockpred: error:`` line holding every ``expected`` text; no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("blockpred: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for text in expected:
        assert text in lines[0], lines[0]


def build_2d_package(root: Path, weights_file: Path, plane: np.ndarray, *, halo: int, min_size: int, step: int,
                     zmuv_axes: tuple[str, ...] | None = None, name: str = "pkg2d",
                     test_output: np.ndarray | None = None) -> Path:
    """A 2D bioimage.io package ``root/name/rdf.yaml`` made by bioimageio.spec (format 0.5): TorchScript weights
    from ``weights_file`` taking (b, 1, y, x) to (b, 2, y, x); input sizes ``min_size + k * step``; an output
    halo of ``halo``; zero-mean-unit-variance preprocessing (over ``zmuv_axes``, else all axes) and a sigmoid.
    ``plane`` is its test input, and its test output what the package makes of it (as bioimage.io's test_model
    runs it: the plane's own mean and standard deviation, the network on the whole plane, no padding), unless
    ``test_output`` is given."""
    from bioimageio.spec import ValidationContext, save_bioimageio_package_as_folder
    from bioimageio.spec.common import FileDescr
    from bioimageio.spec.generic.v0_3 import Author, CiteEntry, Doi, LicenseId
    from bioimageio.spec.model import v0_5 as m
    import torch

    work = root / f"{name}-src"
    work.mkdir()
    np.save(work / "input.npy", plane[None, None].astype(np.float32))
    if test_output is None:
        x = plane.astype(np.float32)
        x = (x - np.float32(x.astype(np.float64).mean())) / np.float32(x.astype(np.float64).std() + 1e-6)
        with torch.inference_mode():
            test_output = torch.sigmoid(torch.jit.load(str(weights_file))(torch.from_numpy(x[None, None]))).numpy()
    np.save(work / "output.npy", np.asarray(test_output, np.float32))
    (work / "weights.pt").write_bytes(Path(weights_file).read_bytes())
    in_axes = [m.BatchAxis(), m.ChannelAxis(channel_names=[m.Identifier("em")])] + [
        m.SpaceInputAxis(id=m.AxisId(a), size=m.ParameterizedSize(min=min_size, step=step)) for a in "yx"]
    out_axes = [m.BatchAxis(), m.ChannelAxis(channel_names=[m.Identifier("fg"), m.Identifier("boundary")])] + [
        m.SpaceOutputAxisWithHalo(id=m.AxisId(a), halo=halo,
                                  size=m.SizeReference(tensor_id=m.TensorId("raw"), axis_id=m.AxisId(a)))
        for a in "yx"]
    zmuv = m.ZeroMeanUnitVarianceDescr() if zmuv_axes is None else m.ZeroMeanUnitVarianceDescr(
        kwargs=m.ZeroMeanUnitVarianceKwargs(axes=[m.AxisId(a) for a in zmuv_axes]))
    with ValidationContext(perform_io_checks=False, root=work):
        descr = m.ModelDescr(
            name=f"blockpred {name}", description="a small 2D U-Net for blockpred's tests and benches",
            authors=[Author(name="blockpred")], cite=[CiteEntry(text="blockpred", doi=Doi("10.1000/xyz"))],
            license=LicenseId("MIT"),
            inputs=[m.InputTensorDescr(id=m.TensorId("raw"), axes=in_axes, test_tensor=FileDescr(source="input.npy"),
                                       preprocessing=[zmuv])],
            outputs=[m.OutputTensorDescr(id=m.TensorId("pred"), axes=out_axes,
                                         test_tensor=FileDescr(source="output.npy"),
                                         postprocessing=[m.SigmoidDescr()])],
            weights=m.WeightsDescr(torchscript=m.TorchscriptWeightsDescr(
                source="weights.pt", pytorch_version=m.Version(torch.__version__.split("+")[0]))),
        )
        folder = save_bioimageio_package_as_folder(descr, output_path=root / name)
    return folder / "rdf.yaml"
