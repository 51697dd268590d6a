"""OME-Zarr pyramids: levels downsampled blockwise below a zarr output, named in its metadata."""

import json
import os

import numpy as np
import ome_zarr_models.v04
import ome_zarr_models.v05
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

import blockpred
from blockpred.cli import main
from blockpred.run.downsample import downsample
from blockpred.geometry import Coord
from blockpred.io import kvzarr, stores
from blockpred.run.pyramid import max_levels, plan_levels
from tests.helpers import write_test_volume

# Pinned so runs compare bitwise and nothing is measured (see tests/cluster/test_scheduler.py).
PINNED = dict(model="tiny", block=16, halo=4, batch_size=1, memory_format="contiguous", local=True, progress=False)


def reference(data: np.ndarray, factor, method: str) -> np.ndarray:
    """Window by window, the slow obvious way: the windows that run past the edge hold what exists."""
    fz, fy, fx = factor
    z, y, x = data.shape[-3:]
    out = np.zeros(data.shape[:-3] + (-(-z // fz), -(-y // fy), -(-x // fx)), dtype=data.dtype)
    for k in range(out.shape[-3]):
        for j in range(out.shape[-2]):
            for i in range(out.shape[-1]):
                window = data[..., k * fz:(k + 1) * fz, j * fy:(j + 1) * fy, i * fx:(i + 1) * fx]
                flat = window.reshape(window.shape[:-3] + (-1,))
                if method == "mean":
                    value = flat.astype(np.float64).mean(axis=-1)
                    if data.dtype.kind in "ui":
                        value = np.rint(value)
                elif method == "mode":
                    value = np.array([_mode(row) for row in flat.reshape(-1, flat.shape[-1])]).reshape(flat.shape[:-1])
                else:
                    value = flat[..., 0]
                out[..., k, j, i] = value
    return out


def _mode(values: np.ndarray):
    found, counts = np.unique(values, return_counts=True)
    return found[counts.argmax()]  # unique sorts: the first of the most frequent is the smallest


# ---------------------------------------------------------------------- downsampling one block


@settings(max_examples=40, deadline=None)
@given(shape=st.tuples(st.integers(1, 6), st.integers(1, 7), st.integers(1, 7)),
       factor=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 2)),
       method=st.sampled_from(["mean", "mode", "stride"]), channels=st.integers(0, 2),
       dtype=st.sampled_from(["uint8", "float32"]), seed=st.integers(0, 2**16))
def test_downsampling_equals_the_window_by_window_reference(shape, factor, method, channels, dtype, seed):
    rng = np.random.default_rng(seed)
    lead = (channels,) if channels else ()
    # Few distinct values, so modes have real ties and majorities.
    data = rng.integers(0, 4, lead + shape).astype(dtype) * (50 if dtype == "uint8" else 0.25)
    data = data.astype(dtype)
    got = downsample(data, Coord(factor), method)
    want = reference(data, factor, method)
    assert got.dtype == data.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_mode_tie_goes_to_the_smallest_value_and_the_edge_counts_only_what_exists():
    data = np.array([7, 7, 3, 3, 9], dtype=np.uint8).reshape(1, 1, 5)
    # Windows [7, 7, 3, 3] -> a tie: 3; [9] alone at the edge: 9 (no made-up zeros win).
    assert downsample(data, Coord((1, 1, 4)), "mode").ravel().tolist() == [3, 9]
    assert downsample(data, Coord((1, 1, 4)), "mean").ravel().tolist() == [5, 9]


# ---------------------------------------------------------------------- the levels


def test_anisotropic_voxels_are_halved_in_the_fine_axes_until_near_isotropic():
    levels = plan_levels(Coord((200, 2000, 2000)), (40.0, 4.0, 4.0), 5, Coord((32, 128, 128)), None)
    assert [tuple(lv.factor) for lv in levels[1:]] == [(1, 2, 2), (1, 2, 2), (1, 2, 2), (2, 2, 2), (2, 2, 2)]
    assert tuple(levels[3].shape) == (200, 250, 250) and tuple(levels[5].shape) == (50, 63, 63)
    assert [tuple(lv.scale) for lv in levels][-1] == (4, 32, 32)


def test_an_axis_of_one_voxel_is_never_halved_and_the_levels_end_when_all_are():
    assert max_levels(Coord((1, 8, 5))) == 3
    levels = plan_levels(Coord((1, 8, 5)), None, 3, Coord((1, 8, 5)), None)
    assert [tuple(lv.shape) for lv in levels] == [(1, 8, 5), (1, 4, 3), (1, 2, 2), (1, 1, 1)]
    with pytest.raises(blockpred.errors.InvalidOptionError, match="between 0 and 3"):
        plan_levels(Coord((1, 8, 5)), None, 4, Coord((1, 8, 5)), None)


def test_a_sharded_levels_shards_cover_one_shard_of_the_level_before():
    levels = plan_levels(Coord((256, 1024, 1024)), None, 3, Coord((64, 64, 64)), Coord((64, 256, 256)))
    # Half a shard per axis, rounded up to whole chunks; once that is one chunk, no shards.
    assert [lv.shards and tuple(lv.shards) for lv in levels] == [(64, 256, 256), (64, 128, 128), None, None]
    levels = plan_levels(Coord((256, 1024, 1024)), None, 2, Coord((32, 32, 32)), Coord((64, 256, 256)))
    assert [lv.shards and tuple(lv.shards) for lv in levels] == [(64, 256, 256), (32, 128, 128), (32, 64, 64)]


# ---------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("pyramid")
    data = rng.integers(0, 255, (20, 44, 38), dtype=np.uint8)
    return write_test_volume(str(root / "in.zarr/raw"), data, voxel_size=(30.0, 6.0, 6.0)), root


def _levels_from_full_resolution(group: zarr.Group, count: int, method: str) -> None:
    """Each level equals the level before, downsampled window by window: so, step by step, level 0."""
    levels = plan_levels(Coord(group["0"].shape[-3:]), (30.0, 6.0, 6.0), count, Coord((16, 16, 16)), None)
    expected = group["0"][...]
    for level in levels[1:]:
        expected = reference(expected, tuple(level.factor), method)
        got = group[str(level.index)][...]
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0 if got.dtype.kind in "ui" else 1e-7)


def test_a_three_level_pyramid_validates_as_ome_zarr_and_its_levels_are_the_downsampled_output(raw):
    source, root = raw
    out = str(root / "three.zarr")
    summary = blockpred.predict(source, out, pyramid=3, **PINNED)
    assert summary.pyramid is not None and len(summary.pyramid.levels) == 4
    assert "pyramid: 3 levels by mean" in str(summary)
    group = zarr.open_group(out, mode="r")
    image = ome_zarr_models.v05.Image.from_zarr(group)
    datasets = image.attributes.ome.multiscales[0].datasets
    assert [d.path for d in datasets] == ["0", "1", "2", "3"]
    # 30x6x6 voxels: y and x halve first; the scale follows and each voxel sits at its window's centre.
    scale, translation = datasets[2].coordinateTransformations
    assert scale.scale == [1.0, 30.0, 24.0, 24.0] and translation.translation == [0.0, 0.0, 9.0, 9.0]
    assert [group[str(i)].shape for i in range(4)] == [(2, 20, 44, 38), (2, 20, 22, 19), (2, 20, 11, 10),
                                                      (2, 10, 6, 5)]
    _levels_from_full_resolution(group, 3, "mean")


def test_a_uint8_output_by_mode_and_a_zarr_v2_output_as_ome_ngff_0_4(raw, tmp_path):
    source, _ = raw
    v2 = write_test_volume(str(tmp_path / "v2.zarr/raw"), zarr.open_array(source, mode="r")[...], zarr_format=2,
                           voxel_size=(30.0, 6.0, 6.0))
    out = str(tmp_path / "v2.zarr/prediction")
    blockpred.predict(v2, out, pyramid=2, pyramid_method="mode", output_dtype="uint8", **PINNED)
    group = zarr.open_group(out, mode="r")
    image = ome_zarr_models.v04.Image.from_zarr(group)
    assert [d.path for d in image.attributes.multiscales[0].datasets] == ["0", "1", "2"]
    assert group["2"].dtype == np.uint8
    _levels_from_full_resolution(group, 2, "mode")


def test_a_sharded_output_gets_its_pyramid_too(raw, tmp_path):
    source, _ = raw
    out = str(tmp_path / "sharded.zarr")
    blockpred.predict(source, out, pyramid=2, shards="block", output_chunks=8, **PINNED)
    group = zarr.open_group(out, mode="r")
    assert group["0"].shards == (2, 16, 16, 16) and group["1"].shards == (2, 16, 8, 8)
    ome_zarr_models.v05.Image.from_zarr(group)
    _levels_from_full_resolution(group, 2, "mean")


def test_levels_a_crash_left_unnamed_are_written_again_and_named_ones_are_kept(raw, tmp_path):
    source, _ = raw
    out = str(tmp_path / "again.zarr")
    blockpred.predict(source, out, pyramid=2, **PINNED)
    # As a crash in the pyramid leaves it: level 1 half written, the metadata naming level 0 only.
    group = zarr.open_group(out, mode="r+")
    group["1"][:, :5] = 0
    attributes = group.attrs.asdict()
    attributes["ome"]["multiscales"][0]["datasets"] = attributes["ome"]["multiscales"][0]["datasets"][:1]
    group.attrs.update(attributes)
    summary = blockpred.predict(source, out, pyramid=2, **PINNED)  # nothing left to predict
    assert summary.stats.num_blocks == 0 and summary.pyramid.num_kept == 0
    _levels_from_full_resolution(zarr.open_group(out, mode="r"), 2, "mean")
    again = blockpred.predict(source, out, pyramid=2, **PINNED)
    assert again.pyramid.num_kept == 2


def test_a_pyramid_on_a_non_zarr_output_or_past_the_last_level_gets_one_line_and_exit_2(raw, tmp_path, capsys):
    source, _ = raw
    cases = [
        ([source, str(tmp_path / "out.n5/pred"), "--pyramid", "2"], "needs a zarr output"),
        ([source, str(tmp_path / "o.h5:/pred"), "--pyramid", "1"], "needs a zarr output"),
        ([source, str(tmp_path / "o.zarr"), "--pyramid", "7"], "at most 6"),
        ([source, str(tmp_path / "o.zarr"), "--pyramid", "-1"], "non-negative number of levels"),
        ([source, str(tmp_path / "o.zarr"), "--pyramid", "2", "--pyramid-method", "max"], "invalid choice"),
    ]
    for args, expected in cases:
        try:
            code = main(["run", *args, "--model", "tiny", "--no-progress", "--local"])
        except SystemExit as exit:  # argparse's own refusals (an unknown choice)
            code = exit.code
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and expected in err[0], (args, err)
        assert sorted(os.listdir(tmp_path)) == [], f"{args}: something was written"


def test_the_command_line_writes_the_pyramid_and_says_so(raw, tmp_path, capsys):
    source, _ = raw
    out = str(tmp_path / "cli.zarr")
    assert main(["run", source, out, "--model", "tiny", "--block", "16", "--halo", "4", "--batch-size", "1",
                 "--memory-format", "contiguous", "--pyramid", "1", "--no-progress", "--local"]) == 0
    assert "pyramid: 1 levels by mean (1: 20x22x19)" in capsys.readouterr().out
    attributes = json.loads((tmp_path / "cli.zarr" / "zarr.json").read_text())["attributes"]
    assert [d["path"] for d in attributes["ome"]["multiscales"][0]["datasets"]] == ["0", "1"]


def test_the_plan_lists_the_levels_it_would_write_and_writes_nothing(raw, tmp_path):
    source, _ = raw
    planned = blockpred.plan(source, str(tmp_path / "planned.zarr"), pyramid=2, pyramid_method="stride", **PINNED)
    assert planned.pyramid == (Coord((20, 22, 19)), Coord((20, 11, 10)))
    assert "pyramid   2 levels by stride after the prediction: 20x22x19, 20x11x10" in str(planned)
    assert not (tmp_path / "planned.zarr").exists()


def test_adding_a_pyramid_to_a_finished_run_predicts_nothing_and_writes_the_levels(raw, tmp_path):
    source, _ = raw
    out = str(tmp_path / "later.zarr")
    blockpred.predict(source, out, **PINNED)
    written = zarr.open_group(out, mode="r")["0"][...]
    summary = blockpred.predict(source, out, pyramid=2, **PINNED)
    assert (summary.stats.num_blocks, summary.num_resumed) == (0, summary.plan.num_blocks)  # nothing redone
    assert len(summary.pyramid.levels) == 3
    np.testing.assert_array_equal(zarr.open_group(out, mode="r")["0"][...], written)
    ome_zarr_models.v05.Image.from_zarr(zarr.open_group(out, mode="r"))
    _levels_from_full_resolution(zarr.open_group(out, mode="r"), 2, "mean")


def test_a_pyramid_on_s3_validates_and_equals_the_same_pyramid_on_local_files(raw, s3, tmp_path):
    source, _ = raw
    local, remote = str(tmp_path / "local.zarr/pred"), s3.url("remote.zarr/pred")
    blockpred.predict(source, local, pyramid=2, **PINNED)
    blockpred.predict(source, remote, pyramid=2, **PINNED)
    container = stores.parse_url(s3.url("remote.zarr"), stores.StorageOptions(endpoint_url=s3.endpoint))
    group = zarr.open_group(kvzarr.zarr_store(container, read_only=True), path="pred", mode="r")
    ome_zarr_models.v05.Image.from_zarr(group)
    here = zarr.open_group(local, mode="r")
    assert group.attrs.asdict() == here.attrs.asdict()
    for level in "012":
        assert group[level][...].tobytes() == here[level][...].tobytes()


@pytest.mark.slow
def test_after_a_run_on_dask_workers_the_workers_write_the_pyramid_the_same_as_in_process(raw, tmp_path):
    source, _ = raw
    here = blockpred.predict(source, str(tmp_path / "here.zarr"), pyramid=2, **PINNED)
    options = {**PINNED, "local": False}
    on_dask = blockpred.predict(source, str(tmp_path / "dask.zarr"), pyramid=2, workers=2, **options)
    assert here.pyramid.num_workers == 0 and on_dask.pyramid.num_workers == 2
    assert "on 2 dask workers" in str(on_dask)
    a, b = zarr.open_group(str(tmp_path / "here.zarr"), mode="r"), zarr.open_group(str(tmp_path / "dask.zarr"), mode="r")
    assert a.attrs.asdict() == b.attrs.asdict()
    for level in "012":
        assert a[level][...].tobytes() == b[level][...].tobytes()
