"""Issue 46: a pass's memory foreseen from the count at a small input, against what a real pass at a block takes.

For each network and block input: the pass foreseen by
:func:`blockpred.tuning.passmemory.count_pass` (counted at 32 voxels per axis on the
network's grid, times the headroom), and

* ``--device cpu``: the growth of this process's resident memory over the network's
  first pass at that input, each case in a fresh process (the first pass's one-time
  costs, threads and kernels, included: a run's first block pays them too);
* ``--device cuda``: ``torch.cuda.max_memory_allocated`` over the first pass at that
  input (cuDNN's search of its kernels included) and a second, the input included, at
  fp32 and at bf16.

    python bench/bench_passmemory.py --device cpu|cuda     (cuda needs torch and pyyaml only)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

GIB, MIB = 2**30, 2**20
CPU_CASES = [("tiny", (276, 276, 276)), ("unet32", (96, 96, 96)), ("unet32", (128, 128, 128)),
             ("cremi2018", (54, 216, 216))]
CUDA_CASES = [("tiny", (276, 276, 276)), ("unet32", (192, 192, 192)), ("unet32", (256, 256, 256)),
              ("cremi2018", (60, 540, 540))]


def one_case(name: str, shape: tuple[int, ...], device: str, precision: str) -> dict:
    """The count and the real pass of one network at one input, in this process."""
    import numpy as np
    import torch

    from blockpred.geometry import Coord
    from blockpred.models.loading import load_model
    from blockpred.pipeline import Predictor
    from blockpred.pipeline.hostmem import ResidentPeak, release_freed_memory, resident_bytes
    from blockpred.run.memcheck import measure_input

    model = load_model(name)
    predictor = Predictor(model.module, torch.device(device), precision)
    result = {"network": name, "input": "x".join(map(str, shape)), "precision": precision}
    if device == "cpu":  # the real pass first: the count's own pass would warm the process for it
        batch = np.zeros((1, 1, *shape), dtype=np.float32)
        release_freed_memory()
        before = resident_bytes()
        with ResidentPeak() as peak:
            predictor(batch)
        result["measured_bytes"] = peak.bytes - before
    from blockpred.tuning.passmemory import count_pass

    counted = count_pass(predictor, 1, measure_input(model.downsampling))
    result["foreseen_bytes"] = counted.pass_bytes(Coord(shape))
    result["bytes_per_voxel"] = counted.bytes_per_voxel
    if device != "cpu":
        peaks = []
        for _ in range(2):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            x = torch.zeros((1, 1, *shape), device=device)
            with torch.inference_mode():
                predictor.forward(x)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - base)  # the input's bytes included
            del x
        result["measured_bytes"], result["second_pass_bytes"] = peaks
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # name:shape:precision, run in a fresh process
    args = parser.parse_args()
    if args.case:
        name, shape, precision = args.case.split(":")
        print(json.dumps(one_case(name, tuple(int(n) for n in shape.split("x")), args.device, precision)))
        return
    cuda = args.device != "cpu"
    for precision in ("fp32", "bf16") if cuda else ("fp32",):
        for name, shape in CUDA_CASES if cuda else CPU_CASES:
            case = f"{name}:{'x'.join(map(str, shape))}:{precision}"
            out = subprocess.run([sys.executable, __file__, "--device", args.device, "--case", case],
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{r['network']} {r['precision']} input {r['input']}: foreseen {r['foreseen_bytes'] / MIB:.0f} MiB "
                  f"({r['bytes_per_voxel']:.0f} B/voxel), measured {r['measured_bytes'] / MIB:.0f} MiB"
                  + (f" (second pass {r['second_pass_bytes'] / MIB:.0f} MiB)" if cuda else "")
                  + f": foreseen / measured {r['foreseen_bytes'] / r['measured_bytes']:.2f}")


if __name__ == "__main__":
    main()
