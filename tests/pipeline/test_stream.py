"""A block stream: one pipeline that outlives the calls feeding it (what a dask worker keeps)."""

from __future__ import annotations

import functools
import itertools
import threading
import time

import numpy as np
import pytest
import torch

from blockpred.pipeline.blocking import plan_blocks
from blockpred.errors import BlockFailedError
from blockpred.geometry import Coord
from blockpred.io import create_volume, open_volume
from blockpred.models import load_model
from blockpred.tuning.network import probe_network
from blockpred.pipeline import PipelineSettings, Predictor, run_blocks
from blockpred.pipeline.prefetch import Idle
from blockpred.pipeline.stream import BlockStream, StreamStoppedError
from tests.helpers import write_test_volume

SHAPE = (32, 64, 64)
BLOCK, HALO = Coord((16, 16, 16)), Coord((4, 4, 4))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A real zarr input, the tiny network, its plan (32 blocks) and the whole-pipeline reference output."""
    root = tmp_path_factory.mktemp("stream")
    data = np.random.default_rng(3).integers(0, 255, SHAPE, dtype=np.uint8)
    source = write_test_volume(str(root / "in.zarr"), data, chunks=(16, 16, 16))
    model = load_model("tiny")
    predictor = Predictor(model.module, torch.device("cpu"))
    geometry = probe_network(predictor, in_channels=1, block=BLOCK, halo=HALO, downsampling=model.downsampling)
    plan = plan_blocks(volume_shape=Coord(SHAPE), block_shape=BLOCK, halo=HALO, input_shape=geometry.input_shape,
                       downsampling=model.downsampling, chunk_shape=BLOCK)
    reference_path = str(root / "reference.zarr")
    with _sink(reference_path) as sink, open_volume(source) as volume:
        run_blocks(plan, source=volume, sink=sink, predictor=predictor, settings=_settings(model))
    with open_volume(reference_path) as reference:
        expected = reference.read(reference.box)
    return {"source": source, "model": model, "predictor": predictor, "plan": plan, "expected": expected,
            "root": root}


def _settings(model, batch_size: int = 1) -> PipelineSettings:
    return PipelineSettings(batch_size=batch_size, downsampling=model.downsampling, num_writers=2, prefetch=4)


def _sink(path: str):
    return create_volume(path, spatial_shape=SHAPE, num_channels=2, dtype="float32", chunk_shape=BLOCK,
                         ome=False, overwrite=True)


class Recorder:
    """In which order the blocks were read (the pipeline's skip hook sees every read block) and written: each
    event's number in one sequence (an order, not a clock)."""

    def __init__(self, fail: set = frozenset()):
        self.read: dict = {}
        self.written: dict = {}
        self.fail = fail
        self._lock = threading.Lock()
        self._events = itertools.count()

    def skip(self, block, data) -> bool:
        with self._lock:
            self.read[block.index] = next(self._events)
        if block.index in self.fail:
            raise RuntimeError(f"unreadable {block.index}")
        return False

    def done(self, block) -> None:
        with self._lock:
            self.written[block.index] = next(self._events)


def _stream(setup, sink, recorder: Recorder, *, batch_size: int = 1, max_failures: int = 10) -> BlockStream:
    runner = functools.partial(run_blocks, source=open_volume(setup["source"]), sink=sink,
                               predictor=setup["predictor"], settings=_settings(setup["model"], batch_size),
                               skip=recorder.skip)
    return BlockStream(runner, max_failures=max_failures, on_block_done=recorder.done)


def _in_thread(function, *args):
    """Run ``function(*args)`` on a thread; a dict that will hold its result or error."""
    outcome: dict = {}

    def target():
        try:
            outcome["result"] = function(*args)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            outcome["error"] = err

    thread = threading.Thread(target=target)
    thread.start()
    outcome["thread"] = thread
    return outcome


def test_two_calls_share_one_pipeline_that_does_not_drain_between_them(setup, tmp_path):
    plan = setup["plan"]
    first, second = [plan.block_from_id(i) for i in range(16)], [plan.block_from_id(i) for i in range(16, 32)]
    gate = threading.Event()

    def gated(blocks):
        gate.wait()
        yield from blocks

    recorder = Recorder()
    with _sink(str(tmp_path / "out.zarr")) as sink:
        stream = _stream(setup, sink, recorder)
        try:
            one = _in_thread(stream.run, gated(first))
            while stream.pending_calls < 1:
                time.sleep(0.001)
            two = _in_thread(stream.run, second)
            while stream.pending_calls < 2:
                time.sleep(0.001)
            gate.set()  # both calls are queued before the first block is handed out
            for outcome in (one, two):
                outcome["thread"].join(60)
                assert "error" not in outcome, outcome.get("error")
        finally:
            stream.close()
        assert not stream.alive
        got = sink.read(sink.box)
    np.testing.assert_array_equal(got, setup["expected"])
    for outcome, blocks in ((one, first), (two, second)):
        counts = outcome["result"]
        assert counts.num_blocks == 16 and counts.num_skipped == 0
        assert counts.num_voxels == sum(b.write_box.size for b in blocks)
        assert counts.seconds > 0
    # The second call's first read happened while the first call still had blocks to write: no drain between them.
    assert min(recorder.read[b.index] for b in second) < max(recorder.written[b.index] for b in first)
    assert stream.stats.compute_s > 0 and 0 < stream.busy_s


def test_a_failing_block_fails_its_call_only_and_the_stream_goes_on(setup, tmp_path):
    plan = setup["plan"]
    bad = plan.block_from_id(3).index
    recorder = Recorder(fail={bad})
    with _sink(str(tmp_path / "out.zarr")) as sink:
        stream = _stream(setup, sink, recorder)
        try:
            one = _in_thread(stream.run, [plan.block_from_id(i) for i in range(8)])
            two = _in_thread(stream.run, [plan.block_from_id(i) for i in range(8, 16)])
            for outcome in (one, two):
                outcome["thread"].join(60)
            three = stream.run([plan.block_from_id(i) for i in range(16, 20)])  # the stream still runs
        finally:
            stream.close()
    error = one["error"]
    assert isinstance(error, BlockFailedError) and tuple(error.block_index) == tuple(bad)
    assert [tuple(i) for i in error.failed] == [tuple(bad)] and "unreadable" in str(error)
    assert two["result"].num_blocks == 8 and three.num_blocks == 4
    assert len(recorder.written) == 19 and bad not in recorder.written


def test_a_call_with_too_many_failures_has_its_other_blocks_withdrawn(setup, tmp_path):
    plan = setup["plan"]
    recorder = Recorder(fail={plan.block_from_id(i).index for i in range(32)})
    with _sink(str(tmp_path / "out.zarr")) as sink:
        stream = _stream(setup, sink, recorder, max_failures=2)
        try:
            with pytest.raises(BlockFailedError, match=r"blocks failed") as info:
                stream.run([plan.block_from_id(i) for i in range(32)])
        finally:
            stream.close()
    assert len(info.value.failed) >= 2
    assert len(recorder.read) < 32, "a call that keeps failing must not be read to its end"


def test_a_partial_batch_is_run_when_the_stream_runs_dry(setup, tmp_path):
    """Batch 4, a call of 3 blocks: they must not wait for a fourth that never comes."""
    plan = setup["plan"]
    recorder = Recorder()
    with _sink(str(tmp_path / "out.zarr")) as sink:
        stream = _stream(setup, sink, recorder, batch_size=4)
        try:
            outcome = _in_thread(stream.run, [plan.block_from_id(i) for i in range(3)])
            outcome["thread"].join(30)
            assert not outcome["thread"].is_alive(), "the call waited on a partial batch"
            assert outcome["result"].num_blocks == 3
            again = stream.run([plan.block_from_id(i) for i in range(3, 7)])
        finally:
            stream.close()
        got = sink.read(sink.box)
    assert again.num_blocks == 4
    for i in range(7):
        box = plan.block_from_id(i).write_box
        np.testing.assert_allclose(got[(slice(None),) + box.to_slices()],  # batched: other conv kernels
                                   setup["expected"][(slice(None),) + box.to_slices()], atol=1e-6)
    assert not got[(slice(None),) + plan.block_from_id(7).write_box.to_slices()].any()


def test_a_stopped_pipeline_fails_the_waiting_calls_and_refuses_new_ones(setup):
    def broken(blocks, **_):
        for item in blocks:  # fails at the first block, as a pipeline whose device is gone would
            if not isinstance(item, Idle):
                raise RuntimeError("device lost")
            item.wait()

    stream = BlockStream(broken, max_failures=10)
    with pytest.raises(StreamStoppedError, match="the block stream stopped: device lost"):
        stream.run([setup["plan"].block_from_id(0)])
    stream._thread.join(10)
    assert not stream.alive
    with pytest.raises(StreamStoppedError, match="closed .*device lost"):
        stream.run([setup["plan"].block_from_id(1)])


def test_a_closed_stream_finishes_its_thread_and_refuses_calls(setup, tmp_path):
    with _sink(str(tmp_path / "out.zarr")) as sink:
        stream = _stream(setup, sink, Recorder())
        assert stream.run([setup["plan"].block_from_id(0)]).num_blocks == 1
        stream.close()
    assert not stream.alive
    with pytest.raises(StreamStoppedError, match="closed"):
        stream.run([setup["plan"].block_from_id(1)])


def test_a_cancelled_close_finishes_only_the_blocks_in_the_pipeline(setup, tmp_path):
    plan = setup["plan"]
    recorder = Recorder()
    first_written = threading.Event()

    def done(block):
        recorder.done(block)
        first_written.set()

    with _sink(str(tmp_path / "out.zarr")) as sink:
        runner = functools.partial(run_blocks, source=open_volume(setup["source"]), sink=sink,
                                   predictor=setup["predictor"], settings=_settings(setup["model"]))
        stream = BlockStream(runner, max_failures=10, on_block_done=done)
        outcome = _in_thread(stream.run, [plan.block_from_id(i) for i in range(32)])
        assert first_written.wait(30)
        stream.close(cancel=True)
        outcome["thread"].join(30)
    assert not stream.alive and not outcome["thread"].is_alive()
    counts = outcome["result"]
    assert 1 <= counts.num_blocks < 32 and counts.num_blocks == len(recorder.written)


def test_newest_first_serves_the_latest_call_first_and_a_withdrawn_call_is_never_read(setup, tmp_path):
    """What ``blockpred serve`` feeds: one call per request, the newest first, a request gone taken back."""
    plan = setup["plan"]
    gate, entered, finished = threading.Event(), threading.Event(), []

    handed: list = []

    def gated(blocks):
        entered.set()
        gate.wait()
        yield from handing(blocks)

    def handing(blocks):
        for block in blocks:
            handed.append(block.index)
            yield block

    recorder = Recorder()
    with _sink(str(tmp_path / "out.zarr")) as sink:
        runner = functools.partial(run_blocks, source=open_volume(setup["source"]), sink=sink,
                                   predictor=setup["predictor"], settings=_settings(setup["model"]),
                                   skip=recorder.skip)
        stream = BlockStream(runner, max_failures=1, on_block_done=recorder.done, newest_first=True)
        try:
            first = stream.submit(gated([plan.block_from_id(0)]), on_finished=finished.append)
            assert entered.wait(30)  # the stream's thread waits in the first call's blocks
            later = [stream.submit(handing([plan.block_from_id(i)]), on_finished=finished.append) for i in (1, 2, 3)]
            assert stream.withdraw(later[1])  # block 2's request went away before it was handed out
            assert later[1] in finished and stream.outcome(later[1]).num_blocks == 0
            gate.set()
            for ticket in (first, later[0], later[2]):
                assert stream.outcome(ticket, wait=True).num_blocks == 1
            assert not stream.withdraw(first)  # through: nothing to take back
        finally:
            stream.close()
    assert handed == [plan.block_from_id(i).index for i in (0, 3, 1)]  # the first was being handed; then the newest
    assert set(recorder.read) == set(handed)  # the withdrawn block was never read
    assert set(finished) == {first, *later} and len(finished) == 4
