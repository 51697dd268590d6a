"""CUDA's 32-bit index limit: the dry run counts a network's largest tensor, and no block search passes it.

On an H200 (2026-11-26) blocks whose tensors passed 2^31 elements ran 62 s a pass (cremi2018) or failed
with an illegal memory access (unet32); see :mod:`blockpred.tuning.tensors`.  The count is tested on real
networks (the preset, the same network scripted, a network whose weights outsize its activations), the limit
on the search over a synthetic device, and the lost device's failure through ``blockpred.predict``.
"""

import numpy as np
import pytest
import torch

import blockpred
from blockpred.errors import BlockFailedError
from blockpred.geometry import Box, Coord
from blockpred.models.presets import build_preset
from blockpred.pipeline import Predictor
from blockpred.tuning.autosize import SizeProblem, search
from blockpred.tuning.network import probe_network
from blockpred.tuning.sizecache import _problem_json
from blockpred.tuning.tensors import INDEX_LIMIT, max_input_voxels, over_index_limit
from tests.helpers import write_test_volume
from tests.tuning.test_autosize import synthetic_device


class WideWeights(torch.nn.Module):
    """Two 64-map convolutions: on a small input the second weight (64x64x3x3x3) outsizes every activation."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv3d(1, 64, 3, padding=1)
        self.b = torch.nn.Conv3d(64, 64, 3, padding=1)
        self.c = torch.nn.Conv3d(64, 1, 1)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def per_voxel(module, block, halo, downsampling, precision="fp32"):
    predictor = Predictor(module, torch.device("cpu"), precision)
    return probe_network(predictor, in_channels=1, block=Coord(block), halo=Coord(halo),
                         downsampling=Coord(downsampling)).largest_per_voxel


def test_the_dry_run_counts_the_largest_activation_per_input_voxel_not_the_weights():
    # tiny: 4 maps at full resolution, concatenated with 4 more on the way up: 8 per voxel
    assert per_voxel(build_preset("tiny"), (32, 32, 32), (8, 8, 8), (2, 2, 2)) == 8.0
    # the same network scripted (its ops seen through the dispatcher) and in bf16
    assert per_voxel(torch.jit.script(build_preset("tiny")), (32, 32, 32), (8, 8, 8), (2, 2, 2), "bf16") == 8.0
    # 64 maps; the 110,592-element weight of the second convolution is not an activation (input 8^3 = 512 voxels)
    assert per_voxel(WideWeights(), (4, 4, 4), (2, 2, 2), (1, 1, 1)) == 64.0


def test_the_limit_in_input_voxels_and_the_elements_over_it():
    assert max_input_voxels(None) is None and max_input_voxels(0.0) is None
    assert max_input_voxels(24.0) * 24 <= INDEX_LIMIT
    # cremi2018 (24 maps per voxel) at the block an H200 ran 62 s a pass: input 138x1053x1053
    assert over_index_limit(24.0, 138 * 1053 * 1053) == 24 * 138 * 1053 * 1053
    assert over_index_limit(24.0, 65 * 694 * 694) is None  # the seed block, 0.13 s a block
    assert over_index_limit(24.0, 65 * 694 * 694, batch_size=3) is not None
    assert over_index_limit(None, 10**12) is None


def _problem(limit):
    return SizeProblem(in_channels=1, raw_dtype=np.dtype("uint8"), halo=Coord((10, 10, 10)),
                       context=Coord((0, 0, 0)), input_extra=Coord((0, 0, 0)), step=Coord((2, 2, 2)),
                       base_block=Coord((16, 16, 16)), roi=Box.from_shape(Coord((512, 512, 512))),
                       max_input_voxels=limit)


@pytest.mark.parametrize("coarse", [False, True])
def test_no_block_or_batch_over_the_limit_is_tried_or_chosen_even_untimed(coarse):
    limit = 70**3
    prob = _problem(limit)
    run, log = synthetic_device(prob, budget_voxels=10**12, launch_s=0.5)  # memory never stops it
    choice = search(prob, run, coarse=coarse, max_total_s=1e9)
    assert log, "nothing was tried"
    assert all(prob.input_shape(block).prod() * batch <= limit for block, batch in log)
    assert prob.input_shape(choice.block).prod() * choice.batch_size <= limit
    unlimited = _problem(None)
    run, log = synthetic_device(unlimited, budget_voxels=10**12, launch_s=0.5)
    assert any(unlimited.input_shape(b).prod() * n > limit for b, n in log + [(search(unlimited, run,
               coarse=coarse, max_total_s=1e9).block, 1)]), "the limit was never in the way: the test tests nothing"


def test_a_limit_keeps_the_cpu_cache_key_and_is_part_of_a_gpu_key():
    assert "max_input_voxels" not in _problem_json(_problem(None))
    assert _problem_json(_problem(1000))["max_input_voxels"] == 1000


def test_a_lost_device_fails_the_run_at_once_in_one_line_without_retries(tmp_path, caplog):
    source = str(tmp_path / "in.zarr")
    write_test_volume(source, np.random.default_rng(0).integers(1, 255, (32, 64, 64), dtype=np.uint8),
                      chunks=(16, 32, 32))
    log = tmp_path / "calls"
    with pytest.raises(BlockFailedError) as raised:
        blockpred.predict(source, str(tmp_path / "out.zarr"), model="tests.networks:loses_the_device",
                          model_kwargs={"log_path": str(log)}, block=(16, 32, 32), halo=(0, 0, 0),
                          batch_size=1, device="cpu", local=True, retries=2)
    error = raised.value
    assert error.permanent
    text = str(error)
    assert "\n" not in text and "an illegal memory access was encountered" in text
    assert "smaller --block" in text and "CUDA_LAUNCH_BLOCKING" not in text
    assert "retrying" not in caplog.text
    calls = log.read_text().count("call")
    assert 1 <= calls < 8, f"{calls} passes on a lost device (8 blocks; a retry would run them again)"


def test_where_the_limit_cuts_the_coarse_ladder_its_last_candidate_is_the_largest_block_under_it():
    # cremi2018's geometry on the H200's volume: the coarse ladder (8x the voxels a step) went 55x486x486
    # (0.53 of the limit) -> 110x783x783 (1.71, 62 s a block); the largest block of the fine ladder under it is
    # a candidate instead of nothing between
    limit = max_input_voxels(24.0)
    prob = SizeProblem(in_channels=1, raw_dtype=np.dtype("uint8"), halo=Coord((14, 135, 135)),
                       context=Coord((0, 0, 0)), input_extra=Coord((0, 0, 0)), step=Coord((1, 27, 27)),
                       base_block=Coord((32, 270, 270)), roi=Box.from_shape(Coord((220, 2304, 2304))),
                       max_input_voxels=limit)
    coarse = prob.candidates(coarse=True)
    assert coarse[:2] == [Coord((32, 270, 270)), Coord((55, 486, 486))]
    assert coarse[-1] == Coord((74, 594, 594))
    assert limit / 2 < prob.input_shape(coarse[-1]).prod() <= limit
    assert all(prob.input_shape(b).prod() <= limit for b in prob.candidates())


class RefusesToBeWatched(torch.nn.Module):
    """Fails under any torch dispatch mode, as a network with its own dispatch tricks might."""

    def forward(self, x):
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if _get_current_dispatch_mode() is not None:
            raise RuntimeError("this network runs under no dispatch mode")
        return x * 2


def test_a_network_the_count_breaks_still_runs_uncounted():
    assert per_voxel(RefusesToBeWatched(), (8, 8, 8), (0, 0, 0), (1, 1, 1)) is None


def test_the_limit_holds_on_cuda_and_wherever_workers_this_process_cannot_see_choose():
    from blockpred.config import RunConfig
    from blockpred.run.sizes import index_limited

    cpu = Predictor(torch.nn.Identity(), torch.device("cpu"))
    assert not index_limited(RunConfig(device="cpu"), cpu)
    assert index_limited(RunConfig(device="cuda"), cpu)  # workers on a cluster joined with --device cuda
    assert index_limited(RunConfig(scheduler="tcp://127.0.0.1:8786"), cpu)  # their devices are not seen here
    assert index_limited(RunConfig(cluster="slurm"), cpu)


@pytest.mark.parametrize("scripted", [False, True], ids=["preset", "torchscript"])
def test_a_first_runs_start_up_on_the_cpu_never_imports_torch_dynamo(tmp_path, scripted):
    """The tensor counts run eager: torch's dispatch modes otherwise import ``torch._dynamo`` at their first
    operation (about 5 s of a run's start-up on an H200, issue 47).  A fresh process and cache: a first run counts."""
    import subprocess
    import sys

    from tests.helpers import child_env

    source = write_test_volume(str(tmp_path / "in.zarr"),
                               np.random.default_rng(2).integers(0, 255, (16, 32, 32), dtype=np.uint8))
    model = "tiny"
    if scripted:
        model = str(tmp_path / "tiny.pt")
        torch.jit.script(build_preset("tiny")).save(model)
    code = ("import sys, blockpred\n"
            f"blockpred.predict({source!r}, {str(tmp_path / 'out.zarr')!r}, model={model!r}, device='cpu', "
            "progress=False)\n"
            "print('torch._dynamo' in sys.modules, 'blockpred.tuning.tensors' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(child_env(), BLOCKPRED_CACHE_DIR=str(tmp_path / "cache")))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"], result.stdout  # counted, without torch._dynamo
