"""Volumes, runs and markers on an object store: a real S3-compatible server (moto_server, see tests/s3server.py)."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import yaml

import blockpred
from blockpred.cli import main
from blockpred.errors import InvalidOptionError
from blockpred.io import open_volume
from blockpred.io.base import parse_volume_path
from blockpred.io.stores import ObjectUrl, StorageOptions, aws_credentials, kvstore_spec
from blockpred.pipeline.markers import DoneMarkers, markers_path
from blockpred.run.prepare import check_output_path, default_output_path
from tests.helpers import child_env, wait_for, write_test_volume

#: Runs compared bitwise name their batch and layout (see tests/cluster/test_scheduler.py).
PINNED = {"batch_size": 1, "memory_format": "contiguous"}
RUN = dict(block=16, halo=4, local=True, progress=False, **PINNED)


def read_all(path: str) -> np.ndarray:
    volume = open_volume(path)
    return volume.read(volume.box)


def em_volume(seed: int = 0, shape=(32, 48, 48)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, shape, dtype=np.uint8)


# ---------------------------------------------------------------------------------------- paths, no server


@pytest.mark.parametrize("text, container, dataset", [
    pytest.param("s3://bkt/a/b/vol.zarr/raw", "s3://bkt/a/b/vol.zarr", "raw", id="zarr-dataset"),
    pytest.param("s3://bkt/vol.zarr", "s3://bkt/vol.zarr", "", id="zarr-container"),
    pytest.param("s3://bkt/em/vol.n5/s0/raw", "s3://bkt/em/vol.n5", "s0/raw", id="n5"),
    pytest.param("gs://bkt/vol.zarr/raw", "gs://bkt/vol.zarr", "raw", id="gcs"),
])
def test_an_object_store_url_round_trips_and_splits_into_container_and_dataset(text, container, dataset):
    vpath = parse_volume_path(text)
    assert str(vpath) == text and str(vpath.container) == container and vpath.dataset == dataset
    assert vpath.is_remote and vpath.absolute() == vpath


def test_outputs_and_markers_of_a_url_stay_on_its_store_beside_it():
    options = StorageOptions(endpoint_url="http://127.0.0.1:9000")
    source = parse_volume_path("s3://bkt/a/vol.zarr/raw", options)
    assert str(default_output_path(source)) == "s3://bkt/a/vol.zarr/prediction"
    bare = default_output_path(parse_volume_path("s3://bkt/a/vol.zarr", options))
    assert str(bare) == "s3://bkt/a/vol.prediction.zarr" and bare.container.options == options
    assert str(markers_path(source)) == "s3://bkt/a/vol.zarr.blockpred/raw"
    assert markers_path(source).options == options  # the markers are reached as the output is
    with pytest.raises(InvalidOptionError, match="inside the input"):
        check_output_path(source, parse_volume_path("s3://bkt/a/vol.zarr/raw/pred", options))
    check_output_path(source, parse_volume_path("s3://other/a/vol.zarr/raw", options))  # another bucket


@pytest.mark.parametrize("text, expected", [
    pytest.param("s3://bkt/f.h5:/raw", "HDF5 is read and written as a local file only", id="hdf5"),
    pytest.param("az://bkt/vol.zarr", "URL scheme 'az'", id="scheme"),
    pytest.param("s3:///vol.zarr", "must name a bucket", id="no-bucket"),
    pytest.param("s3://bkt/volume", "cannot tell the format", id="no-format"),
])
def test_unusable_urls_are_refused_saying_what_to_name(text, expected):
    with pytest.raises(InvalidOptionError, match=expected):
        parse_volume_path(text)


def test_storage_options_parse_from_cli_pairs_and_mappings_and_refuse_unknown_keys():
    parsed = StorageOptions.parse(["endpoint_url=http://h:9000", "region=eu-west-1", "anonymous=true"])
    assert parsed == StorageOptions(endpoint_url="http://h:9000", region="eu-west-1", anonymous=True)
    assert StorageOptions.parse({"endpoint": "http://h:9000", "profile": "lab"}).profile == "lab"
    with pytest.raises(InvalidOptionError, match="unknown storage option 'colour'"):
        StorageOptions.parse({"colour": "blue"})
    with pytest.raises(InvalidOptionError, match="KEY=VALUE"):
        StorageOptions.parse(["endpoint_url"])


def test_credentials_are_named_so_the_aws_chain_only_runs_when_nothing_else_says(monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                 "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    assert aws_credentials(StorageOptions()) == {"type": "default"}
    assert aws_credentials(StorageOptions(anonymous=True)) == {"type": "anonymous"}
    assert aws_credentials(StorageOptions(profile="lab")) == {"type": "profile", "profile": "lab"}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    assert aws_credentials(StorageOptions()) == {"type": "environment"}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://a:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://b:2")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    spec = kvstore_spec(ObjectUrl("s3", "bkt", "vol.zarr"), "raw")
    assert (spec["endpoint"], spec["aws_region"], spec["path"]) == ("http://b:2", "eu-west-1", "vol.zarr/raw/")
    spec = kvstore_spec(ObjectUrl("s3", "bkt", "", StorageOptions(endpoint_url="http://c:3", region="r")))
    assert (spec["endpoint"], spec["aws_region"], spec["path"]) == ("http://c:3", "r", "")


# ---------------------------------------------------------------------------------------- on the server


@pytest.mark.parametrize("zarr_format, output", [
    pytest.param(3, "out.zarr/pred", id="zarr3-to-ome-zarr"),
    pytest.param(2, "out.n5/pred", id="zarr2-to-n5"),
])
def test_a_run_from_s3_to_s3_writes_bitwise_what_the_same_run_on_local_files_writes(s3, tmp_path, zarr_format,
                                                                                     output):
    data = em_volume()
    local_in = write_test_volume(str(tmp_path / "in.zarr/raw"), data, chunks=(16, 16, 16), zarr_format=zarr_format)
    remote_in = write_test_volume(s3.url("em/in.zarr/raw"), data, chunks=(16, 16, 16), zarr_format=zarr_format)
    local = blockpred.predict(local_in, str(tmp_path / output), **RUN)
    remote = blockpred.predict(remote_in, s3.url(f"em/{output}"), **RUN)
    assert remote.stats.num_blocks == local.stats.num_blocks == 2 * 3 * 3
    assert remote.output == s3.url(f"em/{output}")
    assert read_all(s3.url(f"em/{output}")).tobytes() == read_all(str(tmp_path / output)).tobytes()
    again = blockpred.predict(remote_in, s3.url(f"em/{output}"), **RUN)  # resumed from the markers on S3
    assert again.stats.num_blocks == 0 and again.num_resumed == 18
    assert read_all(s3.url(f"em/{output}")).tobytes() == read_all(str(tmp_path / output)).tobytes()
    assert any(k.startswith(f"em/{output.split('/')[0]}.blockpred/pred/done/") for k in s3.keys())


def test_a_precomputed_volume_on_s3_predicts_into_precomputed_on_s3_as_on_local_files(s3, tmp_path):
    data = em_volume()
    local_in = write_test_volume(f"precomputed://{tmp_path / 'em'}", data, chunks=(16, 16, 16))
    remote_in = write_test_volume(f"precomputed://{s3.url('em')}", data, chunks=(16, 16, 16))
    local_out, remote_out = f"precomputed://{tmp_path / 'pred'}", f"precomputed://{s3.url('pred')}"
    blockpred.predict(local_in, local_out, **RUN)
    blockpred.predict(remote_in, remote_out, **RUN)
    assert read_all(remote_out).tobytes() == read_all(local_out).tobytes()
    again = blockpred.predict(remote_in, remote_out, **RUN)  # markers on S3 beside it: nothing left to do
    assert (again.num_resumed, again.stats.num_blocks) == (18, 0)
    assert read_all(remote_out).tobytes() == read_all(local_out).tobytes()
    blockpred.predict(remote_in, remote_out, overwrite=True, **RUN)  # removes only that volume's objects
    assert any(k.startswith("em/") for k in s3.keys()) and read_all(remote_out).tobytes() == read_all(local_out).tobytes()


def _start_run(args, cwd) -> subprocess.Popen:
    env = child_env()
    return subprocess.Popen([sys.executable, "-m", "blockpred", "run", *args, "--no-progress"], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _done(output: str) -> int:
    markers = DoneMarkers.open(markers_path(parse_volume_path(output)))
    return len(markers.done_indices()) if markers is not None else 0


@pytest.mark.slow
def test_a_run_killed_on_s3_resumes_and_computes_only_the_missing_blocks(s3, tmp_path, capsys):
    source = write_test_volume(s3.url("in.zarr/raw"), em_volume(1, (32, 64, 64)), chunks=(16, 16, 16))
    clean = s3.url("clean.zarr/pred")
    blockpred.predict(source, clean, **RUN)
    out = s3.url("out.zarr/pred")
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    config = tmp_path / "run.yaml"
    slow = tmp_path / "slow"  # the network sleeps 0.15 s a pass while this file exists: the first run only
    slow.touch()
    config.write_text(yaml.safe_dump({"model_kwargs": {"log_path": str(first_log), "delay_s": 0.15,
                                                       "delay_while": str(slow)}, "block": 16, "halo": 4, **PINNED}))
    args = [source, out, "--model", "tests.networks:logged", "--config", str(config), "--local"]
    run = _start_run(args, tmp_path)
    wait_for(lambda: _done(out) >= 6, "6 blocks marked done on S3", process=run)
    os.killpg(run.pid, signal.SIGKILL)  # the whole run, mid-block: no flush, no clean-up
    _, stderr = run.communicate(timeout=30)
    # A new process that read and wrote on S3 (its credentials resolved): no AWS chain noise.
    assert "AuthCredentialsProvider" not in stderr and "E1" not in stderr, stderr
    done_before = _done(out)
    assert 6 <= done_before < 32

    first_log.rename(second_log)  # the first run's forward passes, told apart from the rerun's
    slow.unlink()  # the same command again, at full speed, in this process: the kill was the first run's part
    capsys.readouterr()
    assert main(["run", *args, "--no-progress"]) == 0
    stdout = capsys.readouterr().out
    assert f"in {32 - done_before} blocks ({done_before} already done)" in stdout
    first, second = second_log.read_text().split(), first_log.read_text().split()
    assert len(second) == 32 - done_before  # only what was not marked done
    assert len(set(first) | set(second)) == 32
    assert len(set(first) & set(second)) <= 1 + 2 * 4 + 7  # in flight, plus marks of the last second unflushed
    assert _done(out) == 32
    np.testing.assert_array_equal(read_all(out), read_all(clean))


@pytest.mark.parametrize("missing, expected", [
    pytest.param("no-such-bucket-4711/in.zarr/raw", "no bucket 'no-such-bucket-4711'", id="bucket"),
    pytest.param("{bucket}/in.zarr/nothing", "no dataset 'nothing' in", id="dataset"),
    pytest.param("{bucket}/none.zarr/raw", "no zarr container at", id="container"),
])
def test_a_missing_input_on_s3_exits_2_in_one_line_and_creates_nothing(s3, capsys, missing, expected):
    write_test_volume(s3.url("in.zarr/raw"), em_volume(), chunks=(16, 16, 16))
    before = s3.keys()
    code = main(["run", "s3://" + missing.format(bucket=s3.name), s3.url("out.zarr/pred"), "--local",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and expected in err, err
    assert s3.keys() == before


def test_an_existing_output_on_s3_is_refused_and_overwrite_replaces_only_that_dataset(s3, capsys):
    source = write_test_volume(s3.url("in.zarr/raw"), em_volume(), chunks=(16, 16, 16))
    out = s3.url("out.zarr/pred")
    write_test_volume(out, np.ones((8, 8, 8), dtype=np.uint8))  # not ours: no markers
    keep = write_test_volume(s3.url("out.zarr/keep"), np.full((8, 8, 8), 7, dtype=np.uint8))
    before = s3.keys()
    assert main(["run", source, out, "--local", "--no-progress", "--block", "16"]) == 2
    err = capsys.readouterr().err
    assert "exists; pass --overwrite" in err and len(err.strip().splitlines()) == 1
    assert s3.keys() == before
    assert main(["run", source, out, "--local", "--no-progress", "--block", "16", "--overwrite"]) == 0
    assert open_volume(out).shape == (2, 32, 48, 48)
    assert (read_all(keep) == 7).all()
    assert not [k for k in s3.keys() if k.startswith("out.zarr/pred/") and k.endswith("/c/0/0/0")]  # the old array
    assert not [k for k in before if k.startswith("out.zarr/keep") and k not in s3.keys()]


def test_storage_options_reach_input_output_and_markers_without_the_environment(s3, monkeypatch, capsys):
    source = write_test_volume(s3.url("in.zarr/raw"), em_volume(), chunks=(16, 16, 16))
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    out = s3.url("out.zarr/pred")
    args = ["run", source, out, "--local", "--no-progress", "--block", "16", "--batch-size", "1",
            "--memory-format", "contiguous",
            "--storage-option", f"endpoint_url={s3.endpoint}", "--storage-option", "region=us-east-1"]
    assert main(args) == 0
    assert any(k.startswith("out.zarr.blockpred/pred/done/") for k in s3.keys())
    assert main(["run", source, out, "--storage-option", "colour=blue"]) == 2
    assert "unknown storage option 'colour'" in capsys.readouterr().err


def test_anonymous_writes_are_refused_by_the_store_in_one_line(s3, capsys):
    source = write_test_volume(s3.url("in.zarr/raw"), em_volume(), chunks=(16, 16, 16))
    code = main(["run", source, s3.url("out.zarr/pred"), "--local", "--no-progress", "--block", "16",
                 "--storage-option", "anonymous=true"])
    err = capsys.readouterr().err
    assert code == 2 and "access denied" in err and len(err.strip().splitlines()) == 1


def test_marks_on_s3_are_buffered_and_written_as_one_object_per_flush(s3, monkeypatch):
    from blockpred.geometry import Coord
    from blockpred.pipeline import mark_logs
    from blockpred.pipeline.blocking import plan_blocks

    monkeypatch.setattr(mark_logs, "FLUSH_S", 60.0)  # only the count and flush() write here
    monkeypatch.setattr(mark_logs, "FLUSH_MARKS", 4)
    plan = plan_blocks(volume_shape=Coord((24, 32, 40)), block_shape=Coord((8, 8, 8)), halo=Coord((0, 0, 0)))
    path = markers_path(parse_volume_path(s3.url("out.zarr/pred")))
    markers = DoneMarkers.create(path, plan, {"x": 1})
    blocks = list(plan)[:6]
    for block in blocks[:3]:
        markers.mark_done(block)
    assert DoneMarkers.open(path).done_indices() == set()  # buffered, not yet written
    markers.mark_done(blocks[3])  # the 4th mark: written at once, by a timer thread
    wait_for(lambda: len(DoneMarkers.open(path).done_indices()) == 4, "the 4 marks written by the timer thread")
    markers.mark_skipped(blocks[4])
    markers.mark_done(blocks[5])
    markers.flush()  # the end of a job
    again = DoneMarkers.open(path)
    assert again.done_indices() == {b.index for b in blocks if b is not blocks[4]}
    assert again.skipped_indices() == {blocks[4].index}
    logs = [k for k in s3.keys() if k.startswith("out.zarr.blockpred/pred/done/")]
    assert len(logs) == 2 and all(k.endswith(".ids") for k in logs)  # one object per flush, never one per block
    assert len(again.todo_ids()) == plan.num_blocks - 6
