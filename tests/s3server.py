"""A real S3-compatible server for tests: ``moto_server`` as a subprocess on 127.0.0.1.

The ``s3_server`` fixture (``tests/conftest.py``) starts one per test session;
the ``s3`` fixture gives a test a fresh bucket and the AWS environment
(endpoint, fake credentials, region) that points blockpred, and every
subprocess the test starts, at it.
"""

from __future__ import annotations

import itertools
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

#: Fake credentials: moto accepts any.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "blockpred-test", "AWS_SECRET_ACCESS_KEY": "blockpred-test-secret",
               "AWS_REGION": "us-east-1"}
_BUCKETS = itertools.count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """``moto_server`` on a free port of 127.0.0.1, started and waited for; :meth:`stop` kills it."""

    def __init__(self, timeout_s: float = 30.0):
        executable = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([executable, "-H", "127.0.0.1", "-p", str(self.port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1).read()
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not answer on {self.endpoint} within {timeout_s} s")
                time.sleep(0.1)

    def create_bucket(self, prefix: str = "blockpred-test") -> str:
        """A new, empty bucket (moto takes unsigned requests)."""
        name = f"{prefix}-{next(_BUCKETS)}"
        request = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        urllib.request.urlopen(request, timeout=10).read()
        return name

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


@dataclass(frozen=True)
class S3Bucket:
    """A test's bucket on the session's server."""

    server: S3Server
    name: str

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def url(self, key: str) -> str:
        return f"s3://{self.name}/{key}"

    def keys(self) -> list[str]:
        """Every object key in the bucket, sorted."""
        from blockpred.io import stores

        url = stores.parse_url(f"s3://{self.name}", stores.StorageOptions(endpoint_url=self.endpoint))
        return sorted(stores.list_keys(url))
