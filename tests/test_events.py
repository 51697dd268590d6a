"""``--progress-json`` (JSON lines: start, progress, end) and ``run --json``, checked against a JSON schema.

Real runs of the command (``blockpred.cli.main``): a clean one, one with a
block that fails (a network that raises on a marked voxel), the same command
again as a resume, and one on a dask worker (per-worker progress).
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import yaml

from blockpred.cli import main
from tests.helpers import assert_resumed, write_test_volume

_COUNT = {"type": "integer", "minimum": 0}
_RATE = {"type": ["number", "null"], "minimum": 0}
_SHAPE = {"type": "array", "items": _COUNT, "minItems": 3, "maxItems": 3}
SUMMARY = {
    "type": "object",
    "required": ["input", "output", "model", "device", "blocks", "predicted_blocks", "resumed_blocks",
                 "skipped_blocks", "voxels", "seconds", "mvox_per_s", "block", "halo", "batch_size", "workers",
                 "stages_s", "nonfinite", "missing_chunks", "chosen", "started_s", "output_dtype", "backend",
                 "peak_rss_bytes", "halo_source", "halo_covers_field", "receptive_radius", "downsampling"],
    "properties": {"blocks": _COUNT, "predicted_blocks": _COUNT, "resumed_blocks": _COUNT, "voxels": _COUNT,
                   "backend": {"type": "string"}, "peak_rss_bytes": {"type": "integer", "minimum": 1},
                   "halo_source": {"enum": ["named", "model", "field", "valid", "fallback"]},
                   "halo_covers_field": {"type": ["boolean", "null"]},
                   "receptive_radius": {"anyOf": [_SHAPE, {"type": "null"}]},
                   "downsampling": {"anyOf": [_SHAPE, {"type": "null"}]},
                   "mvox_per_s": _RATE, "block": _SHAPE, "halo": _SHAPE, "batch_size": {"type": "integer",
                                                                                       "minimum": 1},
                   "workers": {"type": "object", "additionalProperties": {
                       "type": "object", "required": ["device", "blocks", "mvox_per_s"]}}},
}
EVENT = {
    "type": "object",
    "required": ["event", "time"],
    "properties": {"event": {"enum": ["start", "progress", "end"]}, "time": {"type": "number"}},
    "allOf": [
        {"if": {"properties": {"event": {"const": "start"}}},
         "then": {"required": ["input", "output", "model", "device", "blocks", "blocks_todo", "blocks_resumed",
                               "blocks_masked", "voxels", "block", "halo", "batch_size", "workers"],
                  "properties": {"blocks": _COUNT, "blocks_todo": _COUNT, "blocks_resumed": _COUNT,
                                 "block": _SHAPE, "workers": {"type": ["integer", "null"]}}}},
        {"if": {"properties": {"event": {"const": "progress"}}},
         "then": {"required": ["blocks_done", "blocks_todo", "voxels_done", "mvox_per_s", "eta_s", "workers"],
                  "properties": {"blocks_done": _COUNT, "mvox_per_s": _RATE, "eta_s": _RATE}}},
        {"if": {"properties": {"event": {"const": "end"}, "ok": {"const": True}}},
         "then": {"required": ["ok", "summary"], "properties": {"summary": SUMMARY}}},
        {"if": {"properties": {"event": {"const": "end"}, "ok": {"const": False}}},
         "then": {"required": ["ok", "error", "failed_blocks", "blocks_done"],
                  "properties": {"error": {"type": "string"}, "failed_blocks": _COUNT}}},
    ],
}


def _events(path) -> list[dict]:
    events = [json.loads(line) for line in path.read_text().splitlines()]
    for event in events:
        jsonschema.validate(event, EVENT)
    assert events[0]["event"] == "start" and events[-1]["event"] == "end"
    assert all(e["event"] == "progress" for e in events[1:-1])
    assert [e["time"] for e in events] == sorted(e["time"] for e in events)
    return events


@pytest.fixture
def source(tmp_path) -> str:
    data = np.random.default_rng(8).integers(0, 200, (32, 64, 64), dtype=np.uint8)
    data[20, 40, 50] = 255  # the marked voxel: one block of 16^3
    return write_test_volume(str(tmp_path / "in.zarr"), data)


def test_a_run_writes_start_progress_and_end_with_the_summary_that_json_prints(tmp_path, source, capsys):
    events_path = tmp_path / "events.jsonl"
    assert main(["run", source, str(tmp_path / "out.zarr"), "--block", "16", "--no-progress", "--json",
                 "--progress-json", str(events_path)]) == 0
    printed = json.loads(capsys.readouterr().out)  # the whole stdout: one JSON object
    assert printed.pop("ok") is True
    jsonschema.validate(printed, SUMMARY)
    events = _events(events_path)
    start, end = events[0], events[-1]
    assert (start["blocks"], start["blocks_todo"], start["blocks_resumed"], start["workers"]) == (32, 32, 0, None)
    assert start["voxels"] == 32 * 64 * 64 and start["block"] == [16, 16, 16]
    assert events[-2]["blocks_done"] == 32 and events[-2]["eta_s"] == 0
    assert end["ok"] is True and end["summary"]["predicted_blocks"] == printed["predicted_blocks"] == 32
    assert end["summary"] == printed  # started_s too: both from the process start


def test_a_failed_block_ends_with_the_error_and_the_same_command_resumes_only_it(tmp_path, source, capsys):
    fault = tmp_path / "fault"
    fault.touch()
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model_kwargs": {"fault_file": str(fault)}}))
    events_path = tmp_path / "events.jsonl"
    command = ["run", source, str(tmp_path / "out.zarr"), "--config", str(config), "--model",
               "tests.networks:fails_on_marker", "--block", "16", "--halo", "0", "--batch-size", "1", "--retries", "0",
               "--no-progress", "--progress-json", str(events_path)]
    assert main(command) == 1
    failed = _events(events_path)[-1]
    assert failed["ok"] is False and failed["failed_blocks"] == 1 and "block (1, 2, 3)" in failed["error"]
    assert failed["blocks_done"] == 31

    fault.unlink()
    capsys.readouterr()
    assert main(command) == 0
    said = capsys.readouterr().out
    events = _events(events_path)  # written anew by the resume
    start, end = events[0], events[-1]
    assert (start["blocks"], start["blocks_todo"], start["blocks_resumed"]) == (32, 1, 31)
    assert end["ok"] is True and end["summary"]["resumed_blocks"] == 31 and end["summary"]["predicted_blocks"] == 1
    clean = str(tmp_path / "clean.zarr")  # the same command on a fresh output, the fault gone
    assert main([clean if arg == command[2] else arg for arg in command[:-2]]) == 0
    assert_resumed(said, command[2], clean, num_blocks=32, done_before=31)


@pytest.mark.slow
def test_a_dask_run_reports_progress_per_worker(tmp_path, source):
    events_path = tmp_path / "events.jsonl"
    assert main(["run", source, str(tmp_path / "out.zarr"), "--block", "16", "--batch-size", "1",
                 "--memory-format", "contiguous", "--workers", "1", "--no-progress",
                 "--progress-json", str(events_path)]) == 0
    events = _events(events_path)
    assert events[0]["workers"] == 1
    workers = events[-2]["workers"]  # the last progress: every block, by the worker that wrote it
    assert len(workers) == 1 and sum(w["blocks"] for w in workers.values()) == 32
    assert set(events[-1]["summary"]["workers"]) == set(workers)
