"""Shared pytest configuration.

Test helpers live in ``tests/helpers.py`` as plain functions (no fixtures);
tests import them as ``from tests.helpers import write_test_volume``.  For
that, the repository root must be importable, so it is put on ``sys.path``
here: ``tests/`` has no ``__init__.py`` (``tests/io`` as a package would
shadow the standard library's ``io``).
"""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import contextlib  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

# Never the user's cache (~/.cache/blockpred or their own $BLOCKPRED_CACHE_DIR), from the first import on: fixtures
# of a module or the session run before any test's own cache is set, and child processes inherit this.
_SESSION_CACHE = tempfile.mkdtemp(prefix="blockpred-test-cache-")
os.environ["BLOCKPRED_CACHE_DIR"] = _SESSION_CACHE
# Two test processes (-n 2) and their children share two cores: OpenMP's threads sleep when they wait rather than
# spin (the default spins for a while, the waits of one process taking the core from the other).  No result
# changes; the suite takes less CPU.  Set before torch is first imported here, and inherited by the children.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_configure(config):
    """Under CI=true, a session where a required dependency or ../shared/realdata is missing fails at once (see
    tests/ci.py): no test may skip for it there."""
    from tests.ci import ON_CI, missing_requirements

    if ON_CI and (unmet := missing_requirements()):
        raise pytest.UsageError(f"CI=true, and what the suite needs is missing: {'; '.join(unmet)}. Install the "
                                f"project with its test extra (pip install -e '.[test]') and put ../shared/realdata "
                                f"beside the checkout")


def pytest_runtest_setup(item):
    from tests.ci import missing

    for mark in item.iter_markers("needs"):
        if not mark.kwargs["present"]:
            missing(mark.kwargs["what"])


def pytest_addoption(parser):
    parser.addoption("--slurm", action="store_true", default=False,
                     help="run the tests marked slurm, against a real SLURM (root starts one: see tests/cluster/test_slurm.py)")


def pytest_collection_modifyitems(config, items):
    from tests.ci import ON_CI

    for item in items:  # a missing need, as a skip mark: the summary then names the test (under CI: set-up fails)
        missing = [mark.kwargs["what"] for mark in item.iter_markers("needs") if not mark.kwargs["present"]]
        if missing and not ON_CI:
            item.add_marker(pytest.mark.skip(reason=f"{missing[0]} is missing"))
    _slowest_files_first(items)
    if config.getoption("--slurm"):
        return
    skip = pytest.mark.skip(reason="a SLURM test: run with --slurm (.ci/run does, after the suite)")
    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(skip)


def _slowest_files_first(items) -> None:
    """The files with the most tests marked slow first, each file's tests in their order: the README's command
    hands out whole files (``-n 2 --dist loadfile``) in this order, and a long file handed out last would run
    alone at the end (the suite's tail was ~15 s of one core idle)."""
    slow: dict = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + ("slow" in item.keywords and "slurm" not in item.keywords)
    order = {path: rank for rank, path in enumerate(slow)}  # as collected, among files of one count
    items.sort(key=lambda item: (-slow[item.path], order[item.path]))


def pytest_unconfigure(config):
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _private_size_cache(tmp_path, monkeypatch):
    """Sizes, layouts and throughputs are cached: each test gets its own cache, never the user's."""
    monkeypatch.setenv("BLOCKPRED_CACHE_DIR", str(tmp_path / "blockpred-cache"))


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto_server) on 127.0.0.1 for the whole session (see tests/s3server.py)."""
    from tests.s3server import S3Server

    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """A fresh bucket on :func:`s3_server`, and the AWS environment (endpoint, fake keys) pointing at it."""
    from tests.s3server import CREDENTIALS, S3Bucket

    for name in ("AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    return S3Bucket(s3_server, s3_server.create_bucket())


@pytest.fixture
def immutable():
    """``immutable(path)``: ``chattr +i`` (its entries cannot change, even for root), undone after the test."""
    import subprocess
    from pathlib import Path

    marked: list[Path] = []

    def mark(path: Path) -> None:
        result = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"chattr +i is not available here: {result.stderr.strip()}")
        marked.append(path)

    yield mark
    for path in marked:
        if path.exists():
            subprocess.run(["chattr", "-i", str(path)], check=False)


class SmallDisk:
    """A real file system of its own, a tmpfs of a few MiB mounted in a test's directory (see :func:`tmpfs`)."""

    def __init__(self, path: Path, size: str):
        self.path = path
        self.size = size

    def fill(self, left_bytes: int = 0) -> None:
        """Fill the disk up to ``left_bytes`` free (a file named ``filler``)."""
        stats = os.statvfs(self.path)
        with open(self.path / "filler", "ab") as filler:
            filler.write(b"\0" * max(0, stats.f_bavail * stats.f_frsize - left_bytes))

    def resize(self, size: str) -> None:
        """Grow (or shrink) the disk to ``size`` ("8m"), keeping what it holds: space freed, as an operator would."""
        import subprocess

        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True, capture_output=True)
        self.size = size


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size="2m", name="disk", **options)``: a real, small tmpfs (root only; skipped where it cannot be
    mounted) as a :class:`SmallDisk`; every disk is unmounted after the test."""
    import subprocess

    mounted: list[Path] = []

    def mount(size: str = "2m", name: str = "disk", **options) -> SmallDisk:
        path = tmp_path / name
        path.mkdir()
        flags = ",".join([f"size={size}"] + [f"{key}={value}" for key, value in options.items()])
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", flags, "tmpfs", str(path)], capture_output=True,
                                text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        mounted.append(path)
        return SmallDisk(path, size)

    yield mount
    for path in mounted:
        # A file a library still has open there (tensorstore finishing a failed write on its own threads) makes the
        # disk busy for a moment: it is then detached at once and freed when the last file closes (umount -l).
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


class CrashableDisk:
    """A real ext4 file system on a loop device (see :func:`crashable_disk`), whose disk can be read as a crash
    of the machine would leave it.

    It is mounted with a ten-minute journal commit and without ext4's flush-on-rename: nothing written reaches
    its disk (an image file) within a test unless it was fsynced.  :meth:`crash` copies the image as it is --
    what the disk holds, not what the page cache holds -- and mounts the copy the same way (replaying its
    journal, as a reboot does): what a power cut or a kernel panic at that moment would have left, itself a
    disk that can crash.
    """

    def __init__(self, image: Path, path: Path, mounts: list[Path]):
        self.image = image
        self.path = path
        #: Every mount of this disk and of the copies made from it, unmounted at the end of the test.
        self.mounts = mounts

    def mount(self) -> None:
        import subprocess

        self.path.mkdir()
        result = subprocess.run(["mount", "-o", "loop,commit=600,noauto_da_alloc", str(self.image), str(self.path)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise OSError(f"cannot mount an ext4 image on a loop device here: {result.stderr.strip()}")
        self.mounts.append(self.path)

    def crash(self) -> "CrashableDisk":
        """The file system as the disk holds it now, after a crash and a reboot: a mounted copy."""
        import uuid

        name = f"crashed-{uuid.uuid4().hex[:8]}"
        copy = CrashableDisk(self.image.with_name(f"{name}.img"), self.path.with_name(name), self.mounts)
        shutil.copyfile(self.image, copy.image)
        copy.mount()
        return copy

    def discard(self) -> None:
        """Unmount this copy and delete its image (a test that reads many crashes keeps one at a time)."""
        import subprocess

        subprocess.run(["umount", str(self.path)], check=True, capture_output=True)
        self.mounts.remove(self.path)
        self.image.unlink()

    def unmount(self) -> None:
        import subprocess

        for path in reversed(self.mounts):
            if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(path)], check=True)


@contextlib.contextmanager
def _crashable(tmp_path):
    """A mounted :class:`CrashableDisk`, or (None, why) where this machine cannot make one; unmounted after."""
    import subprocess

    root = tmp_path / "crashable"
    root.mkdir()
    disk = CrashableDisk(root / "disk.img", root / "disk", [])
    for step in (["truncate", "-s", "32M", str(disk.image)], ["mkfs.ext4", "-q", "-F", str(disk.image)]):
        result = subprocess.run(step, capture_output=True, text=True)
        if result.returncode != 0:
            yield None, f"cannot make an ext4 image here ({step[0]}): {result.stderr.strip()}"
            return
    try:
        try:
            disk.mount()
        except OSError as error:  # root only, and a loop device
            yield None, str(error)
            return
        yield disk, ""
    finally:
        disk.unmount()


@pytest.fixture
def crashable_disk(tmp_path):
    """A :class:`CrashableDisk` (root only; skipped where a loop device cannot be mounted), unmounted after the
    test: write to ``.path``, then read ``.crash()`` as the disk would be found after a crash of the machine."""
    with _crashable(tmp_path) as (disk, why):
        if disk is None:
            pytest.skip(why)
        yield disk


@pytest.fixture
def crashable_disk_or_none(tmp_path):
    """:func:`crashable_disk`, or None where none can be mounted (a test that checks more than crashes runs on)."""
    with _crashable(tmp_path) as (disk, _):
        yield disk
