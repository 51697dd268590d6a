"""``blockpred serve``: what a viewer reads over HTTP is what ``blockpred run`` writes, each block computed once,
hostile requests refused, viewed blocks written through for ``run`` to skip, and Ctrl-C ending it."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numcodecs
import numpy as np
import pytest

import blockpred
from blockpred.errors import InvalidOptionError
from blockpred.io import open_volume
from blockpred.serve import serving, viewer
from tests.ci import REALDATA, import_or_skip, needs
from tests.helpers import ROOT, child_env, read_volume, wait_for, write_test_volume

import_or_skip("tornado")
ts = import_or_skip("tensorstore")

#: Pinned: the same blocks in the same batches as the run each test compares with.
PINNED = dict(block=(16, 16, 16), halo=(4, 4, 4), batch_size=1, device="cpu", backend="torch",
              memory_format="contiguous", progress=False)


@pytest.fixture(scope="module")
def volume(tmp_path_factory) -> str:
    data = np.random.default_rng(3).integers(0, 250, (24, 40, 48), dtype=np.uint8)  # 2x3x3 blocks, edges cut
    data[18:22, 34:38, 40:44] = 255  # the marker FailsOnMarker raises on: block (1, 2, 2) only
    return write_test_volume(str(tmp_path_factory.mktemp("serve") / "v.zarr"), data)


def _read(url: str) -> np.ndarray:
    return ts.open({"driver": "zarr", "kvstore": {"driver": "http", "base_url": url}}).result().read().result()


def _status(served) -> dict:
    return json.loads(urllib.request.urlopen(served.status_url).read())


def _get(url: str, method: str = "GET") -> int:
    try:
        return urllib.request.urlopen(urllib.request.Request(url, method=method)).status
    except urllib.error.HTTPError as err:
        return err.code


def _logged(tmp_path: Path) -> dict:
    log = tmp_path / "passes.log"
    return dict(model="tests.networks:logged", model_kwargs={"log_path": str(log)}, trust_pickle=True), log


def test_the_served_prediction_is_what_run_writes_and_the_raw_is_the_input(volume, tmp_path):
    with serving(volume, None, model="tiny", **PINNED) as served:
        got = _read(served.prediction_url + "/0")
        raw = _read(served.raw_url + "/0")
        coarse = _read(served.prediction_url + "/1")  # every block predicted: the coarser level is made
        counts = _status(served)
        link = viewer.link(served)
    if link is not None:  # with the neuroglancer package: a link to its public client on both layers
        assert link.startswith(viewer.PUBLIC_CLIENT) and "prediction.zarr" in urllib.parse.unquote(link)
    summary = blockpred.predict(volume, str(tmp_path / "run.zarr"), model="tiny", **PINNED)
    written = open_volume(summary.output)
    np.testing.assert_array_equal(got, written.read(written.box))  # bitwise: same blocks, batches, threads
    source = open_volume(volume)
    np.testing.assert_array_equal(raw, source.read(source.box))
    assert coarse.shape == (2, 12, 20, 24) and np.isfinite(coarse).all() and coarse.any()
    assert counts["blocks_predicted"] == summary.plan.num_blocks == 18 and counts["blocks_failed"] == 0


def test_sixteen_readers_of_overlapping_chunks_get_each_block_computed_once(volume, tmp_path):
    options, log = _logged(tmp_path)
    keys = [f"0/0.{z}.{y}.{x}" for z in range(2) for y in range(3) for x in range(3)]
    answers: dict = {}

    def reader(seed: int) -> None:
        order = keys[:]
        random.Random(seed).shuffle(order)
        answers[seed] = {key: urllib.request.urlopen(f"{served.prediction_url}/{key}").read() for key in order}

    with serving(volume, None, **options, **PINNED) as served:
        threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        counts = _status(served)
    assert len(answers) == 16 and all(answer == answers[0] for answer in answers.values())
    passes = log.read_text().split()
    assert len(passes) == len(set(passes)) == 18  # each block's input through the network once
    assert counts["blocks_predicted"] == 18 and counts["requests"] == 16 * 18


def test_hostile_and_malformed_requests_are_refused_and_never_a_server_error(volume, tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("not to be served")
    with serving(volume, None, model="tiny", **PINNED) as served:
        base, root = served.base, f"http://127.0.0.1:{served.port}"
        os.symlink(outside, Path(volume) / "link")  # a link beside the input's own files: still nothing served
        for path in ["/prediction.zarr/../../secret.txt", "/prediction.zarr/%2e%2e/%2e%2e/secret.txt",
                     "/prediction.zarr/..%2F..%2Fsecret.txt", "/raw.zarr/link", "/raw.zarr/zarr.json",
                     "/prediction.zarr/0/0.2.0.0", "/prediction.zarr/0/0.0.3.0", "/prediction.zarr/0/1.0.0.0",
                     "/prediction.zarr/0/0.0.0", "/prediction.zarr/0/0.-1.0.0", "/prediction.zarr/0/0.a.0.0",
                     "/prediction.zarr/0/0.00.0.0", "/prediction.zarr/0/0.0.0.99999999999999999999",
                     "/prediction.zarr/9/.zarray", "/prediction.zarr/0/", "/other.zarr/.zattrs", "/status"]:
            assert _get(base + path) == 404, path
        for path in ["//etc/passwd", "/etc/passwd", "/" + "0" * 16 + "/prediction.zarr/.zattrs", "/x%00y"]:
            assert _get(root + path) == 404, path
        for method in ["POST", "PUT", "DELETE", "PATCH"]:
            assert _get(base + "/prediction.zarr/0/0.0.0.0", method) == 405, method
        assert _get(base + "/prediction.zarr/.zattrs", "HEAD") == 200
        with socket.create_connection(("127.0.0.1", served.port)) as raw:  # not HTTP at all
            raw.sendall(b"GARBAGE\r\n\r\n")
            assert raw.recv(64).startswith(b"HTTP/1.1 400")
        conn = http.client.HTTPConnection("127.0.0.1", served.port)
        conn.request("OPTIONS", "/any", headers={"Origin": "https://evil.example"})
        preflight = conn.getresponse()
        preflight.read()
        assert preflight.status == 204 and preflight.getheader("Access-Control-Allow-Origin") is None
        conn.request("GET", f"/{served.fingerprint}/prediction.zarr/.zattrs",
                     headers={"Origin": "https://neuroglancer-demo.appspot.com"})
        allowed = conn.getresponse()
        allowed.read()
        assert allowed.getheader("Access-Control-Allow-Origin") == "https://neuroglancer-demo.appspot.com"
        conn.request("GET", f"/{served.fingerprint}/prediction.zarr/.zattrs", headers={"Host": "evil.example:80"})
        rebound = conn.getresponse()
        rebound.read()
        assert rebound.status == 403  # a page whose name was made to resolve here (DNS rebinding)
        with pytest.raises(InvalidOptionError, match=f"cannot listen on 127.0.0.1:{served.port}"):
            with serving(volume, None, port=served.port, model="tiny", **PINNED):  # the port is taken: at once
                pass
        assert _status(served)["blocks_predicted"] == 0  # none of it reached the network


def test_a_failing_block_is_a_500_for_its_chunk_only_logged_once(volume, tmp_path, caplog):
    fault = tmp_path / "fault"
    fault.write_text("")
    options = dict(PINNED, model="tests.networks:fails_on_marker", model_kwargs={"fault_file": str(fault)},
                   trust_pickle=True, retries=0, halo=(0, 0, 0))
    with serving(volume, None, **options) as served:
        assert _get(served.prediction_url + "/0/0.1.2.2") == 500
        assert _get(served.prediction_url + "/0/0.1.2.2") == 500
        assert _get(served.prediction_url + "/0/0.0.0.0") == 200  # the server goes on
        counts = _status(served)
    failed = [r for r in caplog.records if "block 1x2x2 failed" in r.getMessage()]
    assert len(failed) == 1 and counts["blocks_failed"] == 2 and counts["blocks_predicted"] == 1


def test_blocks_viewed_are_written_through_and_run_skips_them(volume, tmp_path):
    options, log = _logged(tmp_path)
    output = str(tmp_path / "out.zarr")
    with serving(volume, output, **options, **PINNED) as served:
        viewed = [urllib.request.urlopen(f"{served.prediction_url}/0/0.{i}.1.1").read() for i in range(2)]
    assert len(viewed) == 2 and len(log.read_text().split()) == 2
    summary = blockpred.predict(volume, output, **options, **PINNED)
    assert summary.num_resumed == 2 and summary.stats.num_blocks == 16
    assert len(log.read_text().split()) == 18  # the two viewed blocks were not computed again
    reference = blockpred.predict(volume, str(tmp_path / "fresh.zarr"), model="tests.networks:logged",
                                  model_kwargs={"log_path": str(tmp_path / "other.log")}, trust_pickle=True,
                                  **PINNED)
    a, b = open_volume(output), open_volume(reference.output)
    np.testing.assert_array_equal(a.read(a.box), b.read(b.box))


def test_ctrl_c_ends_the_server_with_one_line_and_its_temporary_output_gone(volume, tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    command = [sys.executable, "-m", "blockpred", "serve", volume, "--port", "0", "--model", "tiny", "--block", "16",
               "--device", "cpu", "--backend", "torch", *(["--viewer"] if viewer.available() else [])]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "Ctrl-C stops it" in line:
            break
    url = next(line.split("zarr://", 1)[1].strip() for line in lines if "prediction: zarr://" in line)
    assert urllib.request.urlopen(url + "/0/0.0.0.0").status == 200
    if viewer.available():  # --viewer: neuroglancer's own viewer, served by the same process
        page = next(line.split("viewer:", 1)[1].strip() for line in lines if "viewer:" in line)
        assert urllib.request.urlopen(page).status == 200
    assert any(p.name.startswith("blockpred-serve-") for p in tmp_path.iterdir())
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)  # a hang fails here
    assert process.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "blockpred: interrupted"
    assert not any(p.name.startswith("blockpred-serve-") for p in tmp_path.iterdir())


def _started(command: list[str], **popen) -> tuple[subprocess.Popen, str]:
    """A ``blockpred serve`` process, once it listens; its prediction's URL."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    url = None
    for line in process.stdout:
        if "prediction: zarr://" in line:
            url = line.split("zarr://", 1)[1].strip()
        if "Ctrl-C stops it" in line:
            return process, url
    raise AssertionError(f"blockpred serve did not start: {process.communicate()[1]}")


def _answer(sock: socket.socket) -> tuple[int, bytes]:
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, response.read()


@pytest.mark.slow
@pytest.mark.parametrize("num_signals", [pytest.param(1, id="once"), pytest.param(2, id="twice")])
def test_sigterm_under_200_requests_answers_each_200_or_503_and_ends_in_one_line(tmp_path, num_signals):
    """Each of 200 requests in flight is answered: 200 where its block was in the pipeline (finished, written and
    marked done), 503 where it was still queued (withdrawn); none is cut off.  A connection made after the listener
    closed is refused (what any closed port does; a viewer asks again later).  A second SIGTERM answers 503 at once
    to those still waiting.  No 500, no traceback, one line, exit 143."""
    data = np.random.default_rng(5).integers(1, 250, (40, 40, 80), dtype=np.uint8)  # 2x2x4 blocks, none empty
    volume = write_test_volume(str(tmp_path / "v.zarr"), data)
    gate, held, output = tmp_path / "gate", tmp_path / "held", tmp_path / "out.zarr"
    model = dict(model="tests.networks:gated", model_kwargs={"gate_file": str(gate), "held_file": str(held)},
                 trust_pickle=True)
    pinned = dict(PINNED, block=(20, 20, 20), halo=(10, 10, 10), prefetch=1, num_readers=1)  # the pipeline holds
    # a few blocks: most stay queued; the halo covers the receptive field (no warning on stderr)
    command = [sys.executable, "-m", "blockpred", "serve", volume, str(output), "--port", "0",
               "--model", model["model"], "--model-kwargs", f"gate_file={gate},held_file={held}", "--trust-pickle",
               "--block", "20", "--halo", "10", "--batch-size", "1", "--prefetch", "1", "--readers", "1",
               "--device", "cpu", "--backend", "torch", "--memory-format", "contiguous"]
    process, url = _started(command, cwd=ROOT, env=child_env())
    gate.write_text("")  # from here the network holds every block until the gate opens
    port = int(urllib.parse.urlsplit(url).port)
    path = urllib.parse.urlsplit(url).path
    keys = [(z, y, x) for z in range(2) for y in range(2) for x in range(4)] * 13
    random.Random(5).shuffle(keys)
    keys = keys[:200]  # each block asked for 12 or 13 times
    sockets = []
    for z, y, x in keys:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(f"GET {path}/0/0.{z}.{y}.{x} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        sockets.append(sock)
    status_url = url.rsplit("/", 1)[0] + "/status.json"
    wait_for(lambda: held.exists() and json.loads(urllib.request.urlopen(status_url).read())["requests"] == 200,
             "all 200 requests in, and a block held on the device", process=process)

    process.send_signal(signal.SIGTERM)
    def refused() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port)).close()
        except ConnectionRefusedError:
            return True
        return False

    wait_for(refused, "the listener closed", process=process)  # at once; the process lives on, the held
    assert process.poll() is None  # block's requests unanswered
    if num_signals == 2:  # every request is answered now, though the gate still holds a block
        process.send_signal(signal.SIGTERM)
        answers = [_answer(sock) for sock in sockets]
        gate.unlink()
    else:
        gate.unlink()
        answers = [_answer(sock) for sock in sockets]
    _, err = process.communicate(timeout=120)
    for sock in sockets:
        sock.close()

    codes = [code for code, _ in answers]
    assert process.returncode == 143 and err.strip().splitlines() == ["blockpred: terminated (SIGTERM)"], err
    if num_signals == 2:
        assert codes == [503] * 200
        return
    assert set(codes) <= {200, 503} and codes.count(200) >= 1 and codes.count(503) >= 1, codes
    # What was answered 200 is what the output holds, and those blocks only are marked done.
    blosc = numcodecs.get_codec({"id": "blosc"})
    written = read_volume(output)
    answered = {key for key, (code, _) in zip(keys, answers) if code == 200}
    for key, (code, body) in zip(keys, answers):
        if code == 200:
            box = tuple(slice(20 * i, 20 * i + 20) for i in key)
            got = np.frombuffer(blosc.decode(body), dtype=written.dtype).reshape(2, 20, 20, 20)
            np.testing.assert_array_equal(got, written[(slice(None),) + box])
    resumed = blockpred.predict(volume, str(output), **model, **pinned)
    assert resumed.num_resumed == len(answered) and resumed.stats.num_blocks == 16 - len(answered)
    clean = blockpred.predict(volume, str(tmp_path / "clean.zarr"), **model, **pinned)
    np.testing.assert_array_equal(read_volume(output), read_volume(clean.output))


def test_queued_blocks_whose_requests_went_away_are_withdrawn_before_the_network(volume, tmp_path):
    gate = tmp_path / "gate"
    gate.write_text("")  # the network holds every block until the test opens it
    options = dict(PINNED, model="tests.networks:gated", model_kwargs={"gate_file": str(gate)}, trust_pickle=True,
                   prefetch=1, num_readers=1)
    keys = [f"0/0.{z}.{y}.{x}" for z in range(2) for y in range(3) for x in range(3)][:10]
    with serving(volume, None, **options) as served:
        kept = threading.Thread(target=lambda: urllib.request.urlopen(f"{served.prediction_url}/{keys[0]}").read())
        kept.start()
        path = served.prediction_url.split(str(served.port), 1)[1]
        for key in keys[1:]:  # asked, then gone: the viewer scrolled on
            with socket.create_connection(("127.0.0.1", served.port)) as gone:
                gone.sendall(f"GET {path}/{key} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        # The pipeline is held: the calls not yet in it can only be withdrawn.
        wait_for(lambda: _status(served)["blocks_withdrawn"] >= 1, "a withdrawn block")
        gate.unlink()
        kept.join()
        counts = wait_for(lambda: (c := _status(served))["blocks_withdrawn"] + c["blocks_predicted"] >= len(keys)
                          and c, "every call predicted or withdrawn")
    assert counts["blocks_withdrawn"] >= 1 and counts["blocks_withdrawn"] + counts["blocks_predicted"] == len(keys)
    assert counts["blocks_failed"] == 0


@needs((REALDATA / "cremi_dunet2d").exists(), "../shared/realdata beside the checkout")
def test_a_trained_network_on_real_em_is_served_as_run_writes_it(tmp_path, monkeypatch):
    """The trained 2D CREMI network (a user's model file and state dict) on real FIB-SEM planes, served."""
    from tests import realnets

    monkeypatch.syspath_prepend(str(REALDATA / "cremi_dunet2d"))
    monkeypatch.syspath_prepend(str(realnets.write_inferno_layers(tmp_path / "shim")))
    planes = np.load(REALDATA / "fibsem_neuroproof" / "training_sample2_raw_250cube.npz")["raw"][50:51, 40:136, 40:136]
    source = write_test_volume(str(tmp_path / "fib.zarr"), planes)
    options = dict(model="model:DUNet2D", weights=str(REALDATA / "cremi_dunet2d" / "state.nn"),
                   model_kwargs={"in_channels": 1, "out_channels": 1}, block=(1, 48, 48), batch_size=1,
                   precision="fp32", device="cpu", backend="torch", memory_format="contiguous", progress=False)
    with serving(source, None, **options) as served:
        got = _read(served.prediction_url + "/0")
    summary = blockpred.predict(source, str(tmp_path / "run.zarr"), **options)
    assert summary.plan.num_blocks == 4 and tuple(summary.plan.halo) == (0, 80, 80)
    np.testing.assert_array_equal(got, read_volume(summary.output))
