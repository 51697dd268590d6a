"""An object store that dies mid-run: the run ends soon, with exit 1 and one line naming a block that was not written.

It once ended after almost 5 minutes (every marker object, lock refresh and
flush retried for a minute each), with exit 2 (bad input), a message about a
marker object, and a traceback after it.  Here the store is a real
moto_server, killed; requests are retried twice (``BLOCKPRED_S3_RETRIES``)
so the test is quick; with the default retries the same run ends about a
minute after the kill (see bench/RESULTS.md).
"""

import subprocess
import sys

import numpy as np
import pytest
import yaml

from tests.helpers import child_env, error_line, wait_for, write_test_volume
from tests.s3server import CREDENTIALS, S3Server


@pytest.mark.slow
def test_a_store_killed_mid_run_ends_the_run_with_one_line_naming_an_unwritten_block(tmp_path):
    server = S3Server()
    try:
        bucket = server.create_bucket()
        env = dict(child_env(), **CREDENTIALS, AWS_ENDPOINT_URL=server.endpoint, BLOCKPRED_S3_RETRIES="2")
        data = np.random.default_rng(0).integers(0, 255, (32, 64, 64), dtype=np.uint8)
        source = write_test_volume(str(tmp_path / "in.zarr/raw"), data, chunks=(16, 16, 16))
        log = tmp_path / "passes.log"
        config = tmp_path / "slow.yaml"
        config.write_text(yaml.safe_dump({"model_kwargs": {"log_path": str(log), "delay_s": 0.2}}))
        run = subprocess.Popen(
            [sys.executable, "-m", "blockpred", "run", source, f"s3://{bucket}/out.zarr/pred", "--model",
             "tests.networks:logged", "--config", str(config), "--device", "cpu", "--no-progress", "--block", "16",
             "--halo", "4", "--batch-size", "1", "--memory-format", "contiguous"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: log.exists() and len(log.read_text().split()) >= 4, "4 blocks through the network",
                 process=run)
    finally:
        server.stop()
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 1, stderr
    line = error_line(stderr)
    assert line.startswith("blockpred: error: writing block (") and "run the same command again" in line
    assert not stderr.rstrip().splitlines()[-1].startswith((" ", "Traceback")), stderr
    assert "predicted" not in stdout
