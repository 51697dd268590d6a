"""How long `blockpred run` takes to end once its object store dies, and how it ends.

A real S3 server (moto_server on 127.0.0.1) takes the output; a network that
sleeps ``--delay`` s per pass keeps the run going; the server is killed after
``--after`` blocks have run.  Prints the seconds from the kill to the
command's exit, its exit code, its last stderr line and how many tracebacks
stderr holds.  Default S3 retries (about a minute per request) unless
``--retries`` (BLOCKPRED_S3_RETRIES) says otherwise.

    python bench/bench_store_outage.py [--after 4] [--delay 0.3] [--retries N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers import child_env, write_test_volume  # noqa: E402
from tests.s3server import CREDENTIALS, S3Server  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--after", type=int, default=4, help="blocks run before the store is killed [4]")
    parser.add_argument("--delay", type=float, default=0.3, help="seconds per network pass [0.3]")
    parser.add_argument("--retries", type=int, help="BLOCKPRED_S3_RETRIES [blockpred's default: 10]")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="blockpred-outage-") as work:
        work = Path(work)
        server = S3Server()
        bucket = server.create_bucket()
        env = dict(child_env(), **CREDENTIALS, AWS_ENDPOINT_URL=server.endpoint, BLOCKPRED_CACHE_DIR=str(work / "c"))
        if args.retries is not None:
            env["BLOCKPRED_S3_RETRIES"] = str(args.retries)
        data = np.random.default_rng(0).integers(0, 255, (32, 64, 64), dtype=np.uint8)
        source = write_test_volume(str(work / "in.zarr/raw"), data, chunks=(16, 16, 16))
        log = work / "passes.log"
        (work / "slow.yaml").write_text(yaml.safe_dump({"model_kwargs": {"log_path": str(log),
                                                                         "delay_s": args.delay}}))
        run = subprocess.Popen(
            [sys.executable, "-m", "blockpred", "run", source, f"s3://{bucket}/out.zarr/pred", "--model",
             "tests.networks:logged", "--config", str(work / "slow.yaml"), "--device", "cpu", "--no-progress",
             "--block", "16", "--halo", "4", "--batch-size", "1", "--memory-format", "contiguous"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not log.exists() or len(log.read_text().split()) < args.after:
            if run.poll() is not None:
                raise SystemExit(f"the run ended before the kill: {run.communicate()[1]}")
            time.sleep(0.05)
        server.stop()
        killed = time.monotonic()
        _, stderr = run.communicate()
        ended = time.monotonic() - killed
    lines = stderr.strip().splitlines()
    print(f"ended {ended:.1f} s after the store was killed, exit {run.returncode}, "
          f"{stderr.count('Traceback')} traceback(s) in stderr")
    print(f"last stderr line: {lines[-1] if lines else ''}")


if __name__ == "__main__":
    main()
