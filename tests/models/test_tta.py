"""``--tta``: the mean over input flips equals the mean of the flipped whole-volume predictions, block by block."""

from itertools import combinations

import numpy as np
import pytest
import torch

import blockpred
from blockpred.cli import main
from blockpred.models.tta import passes, with_tta
from tests.helpers import write_test_volume
from tests.pipeline.test_exactness import assert_exact, em_like, halo_covering, make_unet, reference


def _flipped_mean(net, data: np.ndarray, axes: tuple[int, ...], halo) -> np.ndarray:
    """Mean over every subset of ``axes`` (of z, y, x: 0, 1, 2) of: flip, the whole-volume reference, flip back."""
    outputs = []
    for k in range(len(axes) + 1):
        for dims in combinations(axes, k):
            flipped = np.flip(data, dims).copy() if dims else data
            out = reference(net, flipped, halo=halo, downsampling=net.downsampling)
            outputs.append(np.flip(out, tuple(d + 1 for d in dims)) if dims else out)  # +1: the channel axis
    return np.mean(outputs, axis=0)


def test_tta_equals_the_mean_of_the_flipped_whole_volume_predictions(tmp_path):
    mode, axes = "flips", (0, 1, 2)  # flips-yx is the same wrapper over fewer flips (see the next test)
    # A U-Net of one pooling level (downsampling 2, halo 12): 8 blocks x 8 flips of small inputs.  With two levels
    # (halo 28) the same check took 13 s, nearly all of it the passes over the halos.
    data = em_like((8, 16, 20), seed=3)  # every axis a multiple of the downsampling: no extra padding
    source = write_test_volume(str(tmp_path / "in.zarr"), data, chunks=(8, 8, 8))
    net = make_unet(depth=1)
    halo = halo_covering(net, net.downsampling)
    summary = blockpred.predict(source, str(tmp_path / "out.zarr"), model=net, block=(4, 8, 12), halo=halo,
                                tta=mode, batch_size=2, precision="fp32", progress=False, local=True)
    assert summary.stats.num_blocks == 2 * 2 * 2  # blocks meeting at every face, those along x cut by the volume
    expected = _flipped_mean(net, data, axes, halo)
    assert not np.allclose(expected, reference(net, data, halo=halo, downsampling=net.downsampling), atol=1e-4)
    assert_exact(str(tmp_path / "out.zarr"), expected)


def test_a_block_one_plane_deep_averages_the_four_flips_of_y_and_x():
    seen = []

    class Recorder(torch.nn.Module):
        def forward(self, x):
            seen.append(x.clone())
            return x * 2

    x = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(1, 1, 2, 3, 4)
    assert torch.equal(with_tta(Recorder(), "flips")(x), x * 2)  # flipped back: the same as no flip
    assert len(seen) == 8 == passes("flips")
    seen.clear()
    assert torch.equal(with_tta(Recorder(), "flips")(x[:, :, :1]), x[:, :, :1] * 2)
    assert len(seen) == 4 == passes("flips", depth=1) == passes("flips-yx")
    assert with_tta(Recorder, "off") is Recorder


def test_tta_is_part_of_the_outputs_settings_and_a_bad_mode_is_one_line(tmp_path, capsys):
    data = np.random.default_rng(0).integers(0, 255, (16, 32, 32), dtype=np.uint8)
    source = write_test_volume(str(tmp_path / "in.zarr"), data)
    out = str(tmp_path / "out.zarr")
    assert main(["run", source, out, "--block", "16", "--no-progress"]) == 0
    assert main(["run", source, out, "--block", "16", "--no-progress", "--tta", "flips"]) == 2
    assert "(tta off -> flips)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", source, out, "--tta", "rotations"])
