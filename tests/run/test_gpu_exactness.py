"""On a GPU, ``--precision auto`` against fp32 over the whole region (issue 47; skipped without CUDA).

``auto`` runs bf16 or fp16 where its check on the first block passes, and its note states the bound: at most
:data:`~blockpred.tuning.precision.MAX_DIFF` of fp32's output range at any voxel and
:data:`~blockpred.tuning.precision.MEAN_DIFF` of it on average.  Here the bound is held over every voxel of a region
of the real FIB-SEM volume, against blockpred's fp32 prediction of the region in one block (TF32 off: fp32 is
fp32).  The networks: the trained CREMI network of ``../shared/realdata`` and a loop-and-list U-Net, each as a
TorchScript file; a user's factory with a state dict saved once; a preset.  Both runs load the same weights (a
factory built twice without them would draw its weights twice).  None has a normalisation, so its blocks at their
halo equal the one block: any difference is the precision's.
"""

import numpy as np
import pytest
import torch

import blockpred
from blockpred.tuning.precision import MAX_DIFF, MEAN_DIFF, differences
from tests import scripted
from tests.ci import needs
from tests.helpers import REALDATA, read_volume, write_test_volume

FIBSEM = REALDATA / "fibsem_neuroproof" / "training_sample2_raw_250cube.npz"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              needs(FIBSEM.exists(), "../shared/realdata beside the checkout")]


def _model(name: str, root) -> dict:
    """The ``predict`` options that load network ``name`` with weights fixed on disk."""
    if name in scripted.NAMES:
        return dict(model=str(scripted.save(name, root)))
    if name == "tests.realnets:synapse_unet":
        from tests.realnets import synapse_unet

        torch.manual_seed(0)
        weights = root / "synapse_unet.pt"
        torch.save(synapse_unet().state_dict(), weights)
        return dict(model=name, weights=str(weights))
    return dict(model=name)  # a preset: seeded weights


# The region is one block of the fp32 run, so its sides are multiples of each network's downsampling.
@pytest.mark.parametrize("name, region", [("cremi-dunet2d", (48, 192, 192)), ("loop-list", (48, 192, 192)),
                                          ("tests.realnets:synapse_unet", (48, 192, 192)),
                                          ("cremi2018", (48, 216, 216))])
def test_auto_precision_over_a_whole_region_stays_within_the_bound_its_note_states(tmp_path, name, region):
    raw = np.load(FIBSEM)["raw"][tuple(slice(0, s) for s in region)]
    source = write_test_volume(str(tmp_path / "in.zarr"), raw)
    common = dict(_model(name, tmp_path), device="cuda", output_dtype="float32", progress=False)
    auto = blockpred.predict(source, str(tmp_path / "auto.zarr"), precision="auto", **common)
    exact = blockpred.predict(source, str(tmp_path / "fp32.zarr"), precision="fp32", batch_size=1, block=region,
                              halo=tuple(auto.plan.halo), memory_format="contiguous", **common)
    assert exact.stats.num_blocks == 1
    max_diff, mean_diff = differences(read_volume(tmp_path / "auto.zarr"), read_volume(tmp_path / "fp32.zarr"))
    print(f"{name}: {auto.precision} ({auto.precision_note}); {auto.plan.num_blocks} blocks of "
          f"{tuple(auto.plan.block_shape)}; whole region: max {max_diff:.3%}, mean {mean_diff:.4%} of fp32's range")
    if auto.precision in ("bf16", "fp16"):
        assert max_diff <= MAX_DIFF and mean_diff <= MEAN_DIFF
    else:  # a fallback runs tf32, whose products round to 10 bits
        assert max_diff <= 1e-2
