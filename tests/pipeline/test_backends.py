"""``--backend openvino``: every kind of network runs through OpenVINO on the CPU and equals torch at fp32; a
network that does not convert runs with torch and says why; the conversion is cached; workers run it too."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import blockpred
from blockpred.errors import InvalidOptionError
from blockpred.pipeline import Predictor
from blockpred.pipeline.backends import openvino_available
from blockpred.tuning.memformat import choose_memory_format
from tests import realnets
from tests.ci import needs
from tests.helpers import build_2d_package, child_env, read_volume, run_blockpred, write_test_volume

pytestmark = needs(openvino_available(), "OpenVINO (a required dependency)")

TOLERANCE = 1e-5
#: Pinned, so that the two backends run the same blocks in the same batches.
PINNED = dict(block=(16, 32, 32), batch_size=1, precision="fp32", progress=False, local=True)


@pytest.fixture(scope="module")
def volume(tmp_path_factory) -> str:
    data = np.random.default_rng(0).integers(0, 255, (16, 48, 40), dtype=np.uint8)
    return write_test_volume(str(tmp_path_factory.mktemp("backends") / "v.zarr"), data)


def both(volume: str, tmp_path, **options):
    """The same run with torch and with OpenVINO: (torch's output, OpenVINO's output, OpenVINO's summary)."""
    blockpred.predict(volume, str(tmp_path / "torch.zarr"), backend="torch", **{**PINNED, **options})
    summary = blockpred.predict(volume, str(tmp_path / "openvino.zarr"), backend="openvino", **{**PINNED, **options})
    return read_volume(tmp_path / "torch.zarr"), read_volume(tmp_path / "openvino.zarr"), summary


@pytest.fixture(scope="module")
def synapse_weights(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("synapse") / "synapse.pt"
    torch.save(realnets.synapse_unet().state_dict(), path)
    return str(path)


@pytest.mark.parametrize("options", [
    pytest.param(dict(model="tiny"), id="preset"),
    pytest.param(dict(model="tests.realnets:synapse_unet", weights="synapse"), id="factory-and-weights"),
    pytest.param(dict(model="tiny", tta="flips-yx"), id="tta"),
    pytest.param(dict(model="tests.models.test_planes:make_net2d", block=(2, 48, 40), halo=(0, 8, 8)), id="2d-factory"),
])
def test_openvino_equals_torch_at_fp32(volume, tmp_path, synapse_weights, options):
    if options.get("weights") == "synapse":
        options = {**options, "weights": synapse_weights}
    expected, got, summary = both(volume, tmp_path, **options)
    assert summary.backend == "openvino"
    np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0)


def test_torchscript_files_and_a_bioimageio_package_run_through_openvino(volume, tmp_path):
    # A scripted 3D U-Net that upsamples by F.interpolate (its scripted branches on the input's rank are traced
    # through and frozen), and a scripted 2D network that upsamples by a transposed convolution, also packaged.
    from blockpred.models.unet import UNet3d

    torch.manual_seed(0)
    nets = {"unet3d": (UNet3d(in_channels=1, out_channels=2, depth=2, initial_features=4).eval(), {}),
            "transposed2d": (realnets.transposed_net2d(), dict(block=(2, 48, 40), halo=(0, 8, 8)))}
    for name, (net, options) in nets.items():
        path = tmp_path / f"{name}.pt"
        torch.jit.script(net).save(str(path))
        expected, got, summary = both(volume, tmp_path / name, model=str(path), **options)
        assert summary.backend == "openvino", name
        np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0)
    plane = np.random.default_rng(1).random((48, 40)).astype(np.float32)
    package = build_2d_package(tmp_path, path, plane, halo=8, min_size=32, step=8)  # the volume's statistics
    expected, got, summary = both(volume, tmp_path / "pkg", model=str(package), block=(2, 48, 40))
    assert summary.backend == "openvino"
    np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0)


class Opaque(torch.nn.Module):
    """A network the tracer cannot follow: it leaves torch for numpy, so a trace records a constant."""

    def forward(self, x):
        return torch.from_numpy(np.tanh(x.detach().cpu().numpy()))


def test_a_network_that_does_not_convert_runs_with_torch_and_one_line_says_why(volume, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="blockpred"):
        summary = blockpred.predict(volume, str(tmp_path / "o.zarr"), model=Opaque(), backend="openvino",
                                    **{**PINNED, "halo": 0})
    warned = [r.getMessage() for r in caplog.records if "--backend openvino" in r.getMessage()]
    assert len(warned) == 1 and "running it with torch" in warned[0], warned
    assert summary.backend.startswith("torch (openvino: ")
    expected = np.tanh(read_volume(volume).astype(np.float32) / 255)
    np.testing.assert_allclose(read_volume(tmp_path / "o.zarr")[0], expected, atol=1e-6, rtol=0)


def test_the_conversion_is_cached_and_a_second_predictor_converts_nothing(caplog):
    from blockpred.models import build_preset

    net, batch = build_preset("tiny"), np.random.default_rng(0).random((1, 1, 24, 24, 24), dtype=np.float32)
    first = Predictor(net, torch.device("cpu"), backend="openvino", backend_key={"name": "tiny-cache-test"})
    first(batch)
    second = Predictor(net, torch.device("cpu"), backend="openvino", backend_key={"name": "tiny-cache-test"})
    np.testing.assert_array_equal(second(batch), first(batch))
    assert (first._forward.cached, second._forward.cached) == (False, True)
    assert first.backend_note == second.backend_note == "openvino"


def test_a_dask_worker_runs_the_backend_of_the_run(volume, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="blockpred.pipeline"):
        summary = blockpred.predict(volume, str(tmp_path / "dask.zarr"), model="tiny", backend="openvino",
                                    **{**PINNED, "local": False, "workers": 1})
    (worker,) = summary.workers.values()
    assert worker.num_blocks == summary.plan.num_blocks and summary.backend == "openvino"
    # The client converted at its dry run; the worker (in this process) read that conversion from the cache.
    assert any("read from the cache" in r.getMessage() for r in caplog.records)
    blockpred.predict(volume, str(tmp_path / "torch.zarr"), model="tiny", backend="torch", **PINNED)
    np.testing.assert_allclose(read_volume(tmp_path / "dask.zarr"), read_volume(tmp_path / "torch.zarr"), atol=TOLERANCE,
                               rtol=0)


def test_auto_times_openvino_beside_the_layouts_and_caches_its_choice(tmp_path):
    from blockpred.cache import JsonFile
    from blockpred.models import build_preset

    predictor = Predictor(build_preset("tiny"), torch.device("cpu"), backend_key={"name": "tiny-auto-test"})
    cache = JsonFile(tmp_path / "formats.json")
    shape = (1, 1, 36, 36, 36)
    first = choose_memory_format(predictor, shape, {"name": "tiny"}, cache=cache, quick=True,
                                 backends=("torch", "openvino"))
    assert set(first.seconds) == {"contiguous", "channels_last", "openvino"} and first.seconds["openvino"] > 0
    assert predictor.backend == first.backend and not first.cached
    again = choose_memory_format(predictor, shape, {"name": "tiny"}, cache=cache, quick=True,
                                 backends=("torch", "openvino"))
    assert again.cached and (again.backend, again.memory_format) == (first.backend, first.memory_format)
    # A run whose budget times OpenVINO but not torch's other layout: cached under every candidate all the same.
    from blockpred.tuning.memformat import NOT_TIMED

    short = choose_memory_format(predictor, (1, 1, 20, 20, 20), {"name": "tiny"}, cache=cache, quick=True,
                                 backends=("torch", "openvino"), skip=("channels_last",),
                                 known={"contiguous": 1e9})  # torch's pass "known" slow: OpenVINO wins
    assert short.seconds["channels_last"] == NOT_TIMED and short.backend == "openvino" and not short.cached
    assert "not timed within the run's budget: channels_last" in str(short)
    read = choose_memory_format(predictor, (1, 1, 20, 20, 20), {"name": "tiny"}, cache=cache, quick=True,
                                backends=("torch", "openvino"), cached_only=True)
    assert read.cached and read.backend == "openvino"
    # OpenVINO left untimed: used by this run, never cached, so that a longer run still gets OpenVINO's trial.
    crop = choose_memory_format(predictor, (1, 1, 12, 12, 12), {"name": "tiny"}, cache=cache, quick=True,
                                backends=("torch", "openvino"), skip=("openvino",))
    assert crop.seconds["openvino"] == NOT_TIMED and crop.backend == "torch"
    assert choose_memory_format(predictor, (1, 1, 12, 12, 12), {"name": "tiny"}, cache=cache, quick=True,
                                backends=("torch", "openvino"), cached_only=True) is None


def test_openvino_is_refused_in_one_line_off_the_cpu_or_compiled():
    from blockpred.models import build_preset

    with pytest.raises(InvalidOptionError, match="--backend openvino runs on the CPU, uncompiled; on cuda"):
        Predictor(build_preset("tiny"), torch.device("cuda"), backend="openvino")
    with pytest.raises(InvalidOptionError, match="drop --compile"):
        Predictor(build_preset("tiny"), torch.device("cpu"), backend="openvino", compile="default")


class _TracedOtherwise(torch.nn.Module):
    """Traced, it doubles; run, it does not: no conversion of it matches torch."""

    def forward(self, x):
        return x * 2 if torch.jit.is_tracing() else x


def test_a_conversion_that_fails_its_check_is_never_cached_and_a_size_bound_trace_is_made_at_the_block(tmp_path):
    """Converted at a small example, a network that crops by its input's size off its grid does not match at the
    block: it is converted again at the block's shape, and only what passed its check reaches the cache."""
    from blockpred.cache import default_cache_dir
    from blockpred.pipeline.backends import OpenVINONetwork

    cache = default_cache_dir() / "openvino"
    drifting = OpenVINONetwork(_TracedOtherwise(), precision="fp32", key={"name": "other"})
    drifting(torch.rand(1, 1, 16, 16, 16))
    assert drifting.converted is False and "differs from torch" in drifting.reason
    assert not list(cache.glob("*.xml")), "a conversion that failed its check was cached"

    net, x = realnets.valid_unet().eval(), torch.rand(1, 1, 60, 76, 92)
    valid = OpenVINONetwork(net, precision="fp32", key={"name": "valid"})
    assert tuple(valid.example(x).shape) != tuple(x.shape)  # a small example is tried first
    with torch.inference_mode():
        got, expected = valid(x), net(x)
    assert valid.converted is True, valid.reason
    np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=TOLERANCE * float(np.ptp(expected.numpy())))
    assert len(list(cache.glob("*.xml"))) == 1


class _ShapesSeen(torch.nn.Module):
    """``tiny``, noting the spatial shape of every input it runs."""

    def __init__(self):
        super().__init__()
        from blockpred.models import build_preset

        self.net, self.seen = build_preset("tiny").eval(), []

    def forward(self, x):
        self.seen.append(tuple(x.shape[2:]))
        return self.net(x)


def test_the_check_takes_torchs_output_where_it_is_given_and_fails_where_it_is_not_torchs():
    from blockpred.pipeline.backends import OpenVINONetwork

    net, batch = _ShapesSeen(), np.random.default_rng(1).random((1, 1, 24, 24, 24), dtype=np.float32)
    with torch.inference_mode():
        expected = net.net(torch.from_numpy(batch)).numpy()
    given = OpenVINONetwork(net, precision="fp32", key=None)
    given.reference = (batch, expected)
    given(torch.from_numpy(batch))
    assert given.converted is True and (24, 24, 24) not in net.seen  # traced at a smaller example; checked by it
    wrong = OpenVINONetwork(net, precision="fp32", key=None)
    wrong.reference = (batch, expected + 0.5)
    wrong(torch.from_numpy(batch))
    assert wrong.converted is False and "differs from torch" in wrong.reason


def test_a_conversion_sends_no_telemetry_and_writes_nothing_into_home(tmp_path, volume):
    # OpenVINO's import and converter otherwise write a client id and usage counts into ~/intel and send them
    # (except in CI, which the child's environment is not).
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in child_env().items() if k not in ("CI", "TF_BUILD", "JENKINS_URL")}
    env.update(HOME=str(home), BLOCKPRED_CACHE_DIR=str(tmp_path / "cache"))
    result = run_blockpred("run", volume, tmp_path / "out.zarr", "--model", "tiny", "--backend", "openvino",
                           "--block", "16,32,32", "--device", "cpu", "--no-progress", env=env)
    assert result.returncode == 0, result.stderr
    assert "backend: openvino" in result.stdout + result.stderr
    assert not (home / "intel").exists(), sorted(p.name for p in (home / "intel").iterdir())


def test_a_quick_size_trial_on_openvino_times_a_pass_after_a_warm_up():
    # OpenVINO's first pass at a new shape prepares its kernels for it (a 12-feature U-Net's 128x120x120 block:
    # 2.5-3.1 s cold, 1.8 s warm): timed cold against a warm start block, every larger block would look slower.
    from blockpred.geometry import Box, Coord
    from blockpred.models import build_preset
    from blockpred.tuning.autosize import SizeProblem, trial_runner

    predictor = Predictor(build_preset("tiny"), torch.device("cpu"), backend="openvino")
    predictor(np.random.default_rng(0).random((1, 1, 36, 36, 36), dtype=np.float32))  # converted and checked
    shapes, infer = [], predictor.converted._infer
    predictor.converted._infer = lambda x: shapes.append(x.shape[2:]) or infer(x)
    problem = SizeProblem(in_channels=1, raw_dtype=np.dtype("uint8"), halo=Coord((10, 10, 10)),
                          context=Coord((0, 0, 0)), input_extra=Coord((0, 0, 0)), step=Coord((2, 2, 2)),
                          base_block=Coord((16, 16, 16)), roi=Box.from_shape(Coord((64, 64, 64))))
    trial = trial_runner(predictor, problem, quick=True)(Coord((32, 32, 32)), 1)
    assert trial.outcome == "ok"
    assert shapes == [(52, 52, 52), (52, 52, 52)]  # a warm-up, then the timed pass


def test_openvino_on_the_cpu_takes_a_larger_block_untimed_only_within_the_memory_budget(tmp_path):
    # A short run whose budget times no block beyond the start block: OpenVINO costs the same per input voxel at any
    # block, so the next one, which computes far less halo, is taken untimed; torch's larger blocks are slower per
    # voxel, so it keeps what it timed; neither takes a block its memory budget is not foreseen to hold.
    from blockpred.geometry import Box, Coord
    from blockpred.models import build_preset
    from blockpred.tuning.autosize import SizeCache, SizeProblem, Trial, choose_sizes
    from blockpred.tuning.hostbudget import HostBudget

    problem = SizeProblem(in_channels=1, raw_dtype=np.dtype("uint8"), halo=Coord((10, 10, 10)),
                          context=Coord((0, 0, 0)), input_extra=Coord((0, 0, 0)), step=Coord((2, 2, 2)),
                          base_block=Coord((16, 16, 16)), roi=Box.from_shape(Coord((64, 64, 64))))
    start = Coord((16, 16, 16))  # reads 36^3; 32^3 reads 52^3 (3.0 times), 8 blocks against 64 over the region
    known = (Trial(start, 1, "ok", start.prod() / 0.01 / 1e6, 0.01),)

    def chosen(backend: str, limit_bytes: int, name: str):
        predictor = Predictor(build_preset("tiny"), torch.device("cpu"), backend=backend)
        return choose_sizes(predictor, problem, model_key={"name": name}, cache=SizeCache(tmp_path / f"{name}.json"),
                            quick_s=0.0, known=known,  # outputs as the run keeps them: tiny's 2 channels of float32
                            host_budget=HostBudget(limit_bytes=limit_bytes, output_bytes_per_voxel=8.0))

    roomy = chosen("openvino", 64 * 2**30, "roomy")
    assert roomy.block == Coord((32, 32, 32)) and roomy.estimated, roomy
    tight = chosen("openvino", 1, "tight")  # no room even for what the process holds
    assert tight.block == start and not tight.estimated, tight
    torch_choice = chosen("torch", 64 * 2**30, "torch")
    assert torch_choice.block == start and not torch_choice.estimated, torch_choice


def test_joining_a_cluster_the_size_trials_on_its_worker_run_the_runs_backend(volume, tmp_path):
    import json

    from distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        summary = blockpred.predict(volume, str(tmp_path / "out.zarr"), model="tiny", backend="openvino",
                                    block="auto", precision="fp32", progress=False,
                                    scheduler=cluster.scheduler_address)
    assert summary.sizing is not None and summary.plan.block_shape == summary.sizing.block
    entries = json.loads((tmp_path / "blockpred-cache" / "sizes.json").read_text())  # the worker's cache
    backends = {entry["key"].get("backend", "torch") for found in entries.values() for entry in found}
    assert backends == {"openvino"}, backends  # before: the worker's trials ran torch


def test_a_workers_trials_run_the_network_as_its_blocks_do_with_the_runs_tta_and_backend():
    from blockpred.models.tta import FlipAverage
    from blockpred.pipeline.job import ModelSpec
    from blockpred.run.formats import worker_predictor

    spec = ModelSpec("tiny", None, {}, False, None)
    plain = worker_predictor(spec, "cpu", "fp32")
    flipped = worker_predictor(spec, "cpu", "fp32", "flips-yx", backend="openvino", backend_key={"name": "w"})
    assert not isinstance(plain.module, FlipAverage) and plain.backend == "torch"
    assert isinstance(flipped.module, FlipAverage) and flipped.backend == "openvino"
    batch = np.random.default_rng(0).random((1, 1, 24, 24, 24), dtype=np.float32)
    expected = Predictor(FlipAverage(spec.load().module, (3, 4)), torch.device("cpu"))(batch)
    np.testing.assert_allclose(flipped(batch), expected, atol=TOLERANCE, rtol=0)


def test_a_block_chosen_untimed_is_timed_by_the_runs_passes_and_the_next_run_confirms_it_or_steps_back(tmp_path):
    # The guess of the test above, timed by the run's own passes (confirm_guess): where it ran faster than the start
    # block per voxel over the region, the next run takes it as timed; where it ran slower, the next run steps back
    # to the start block.  Either way nothing is timed again.
    from blockpred.geometry import Box, Coord
    from blockpred.models import build_preset
    from blockpred.tuning.autosize import SizeCache, SizeProblem, Trial, choose_sizes, confirm_guess
    from blockpred.tuning.hostbudget import HostBudget

    problem = SizeProblem(in_channels=1, raw_dtype=np.dtype("uint8"), halo=Coord((10, 10, 10)),
                          context=Coord((0, 0, 0)), input_extra=Coord((0, 0, 0)), step=Coord((2, 2, 2)),
                          base_block=Coord((16, 16, 16)), roi=Box.from_shape(Coord((64, 64, 64))))
    start, guess = Coord((16, 16, 16)), Coord((32, 32, 32))
    known = (Trial(start, 1, "ok", start.prod() / 0.01 / 1e6, 0.01),)
    predictor = Predictor(build_preset("tiny"), torch.device("cpu"), backend="openvino")

    def chosen(cache: SizeCache, **options):
        return choose_sizes(predictor, problem, model_key={"name": "guess"}, cache=cache,
                            host_budget=HostBudget(limit_bytes=64 * 2**30, output_bytes_per_voxel=8.0), **options)

    for seconds, expected in ((0.03, guess), (0.2, start)):  # 8 blocks at 0.03 s beat 64 at 0.01; at 0.2 they lose
        cache = SizeCache(tmp_path / f"{seconds}.json")
        first = chosen(cache, quick_s=0.0, known=known)
        assert first.block == guess and first.estimated and first.guess is not None, first
        assert confirm_guess(first, seconds, 1, cache=cache, passes=1) is None  # its one pass was cold
        checks = cache.get_entry(*first.guess).checks
        trial = confirm_guess(first, seconds, 1, cache=cache)
        assert trial is not None and trial.block == guess and trial.seconds_per_pass == seconds
        assert cache.get_entry(*first.guess).checks == checks + 1  # the run's passes checked it: no trial again
        second = chosen(cache, quick_s=0.0, cached_only=True)  # what the next run finds: no trial runs
        # 64^3, one block, is no step on from 32^3: its one pass, cold, counted twice, saves under 10%
        assert second.block == expected and not second.estimated, (seconds, second)
        assert second.complete  # no re-check due: the winner leads by far, and was timed twice
        assert confirm_guess(second, seconds, 1, cache=cache) is None  # a timed block is no guess
