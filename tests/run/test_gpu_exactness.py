"""On a GPU, ``--precision auto`` against fp32 over the whole region (issue 47; skipped without CUDA).

``auto`` runs bf16 or fp16 where its check on the first block passes, and its note states the bound: at most
:data:`~blockpred.tuning.precision.MAX_DIFF` of fp32's output range at any voxel and
:data:`~blockpred.tuning.precision.MEAN_DIFF` of it on average.  Here the bound is held over every voxel of a region
of the real FIB-SEM volume, against blockpred's fp32 prediction of the region in one block (TF32 off: fp32 is
fp32), for networks written as users write them and a preset.
"""

import numpy as np
import pytest
import torch

import blockpred
from blockpred.tuning.precision import MAX_DIFF, MEAN_DIFF, differences
from tests.ci import needs
from tests.helpers import REALDATA, read_volume, write_test_volume

FIBSEM = REALDATA / "fibsem_neuroproof" / "training_sample2_raw_250cube.npz"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              needs(FIBSEM.exists(), "../shared/realdata beside the checkout")]


@pytest.mark.parametrize("model", ["tests.realnets:synapse_unet", "tests.realnets:valid_unet", "cremi2018"])
def test_auto_precision_over_a_whole_region_stays_within_the_bound_its_note_states(tmp_path, model):
    raw = np.load(FIBSEM)["raw"][:48, :192, :192]
    source = write_test_volume(str(tmp_path / "in.zarr"), raw)
    common = dict(model=model, device="cuda", output_dtype="float32", progress=False)
    auto = blockpred.predict(source, str(tmp_path / "auto.zarr"), precision="auto", **common)
    exact = blockpred.predict(source, str(tmp_path / "fp32.zarr"), precision="fp32", batch_size=1,
                              block=tuple(-(-s // 16) * 16 for s in raw.shape), halo=tuple(auto.plan.halo),
                              memory_format="contiguous", **common)
    assert exact.stats.num_blocks == 1
    max_diff, mean_diff = differences(read_volume(tmp_path / "auto.zarr"), read_volume(tmp_path / "fp32.zarr"))
    print(f"{model}: {auto.precision} ({auto.precision_note}); whole region: max {max_diff:.3%}, "
          f"mean {mean_diff:.4%} of fp32's range")
    if auto.precision in ("bf16", "fp16"):
        assert max_diff <= MAX_DIFF and mean_diff <= MEAN_DIFF
    else:  # a fallback runs tf32, whose products round to 10 bits
        assert max_diff <= 1e-2
