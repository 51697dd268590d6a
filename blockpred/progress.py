"""The progress bar of a run: an observer the runner calls as blocks finish."""

from __future__ import annotations

import threading
import time


class ProgressBar:
    """A tqdm bar over blocks with Mvox/s; a no-op when disabled.  Called with (blocks, voxels[, worker])."""

    def __init__(self, num_blocks: int, enabled: bool):
        self._num_blocks = num_blocks
        self._enabled = enabled
        self._bar = None
        self._voxels = 0
        self._first: tuple[float, int] | None = None
        self._lock = threading.Lock()

    def __enter__(self):
        if not self._enabled:
            return None
        from tqdm.auto import tqdm

        self._bar = tqdm(total=self._num_blocks, unit="block", desc="blockpred", dynamic_ncols=True)
        return self._update

    def _update(self, blocks: int, voxels: int, worker: str | None = None) -> None:
        with self._lock:
            now = time.perf_counter()
            if self._first is None:  # rate from the first finished block: start-up is not throughput
                self._first = (now, voxels)
            self._voxels += voxels
            since, counted = self._first
            if now > since:
                rate = (self._voxels - counted) / (now - since) / 1e6
                self._bar.set_postfix_str(f"{rate:.2f} Mvox/s", refresh=False)
            self._bar.update(blocks)

    def write(self, line: str) -> None:
        """``line`` on stderr, above the bar while there is one (a plain print would be drawn over)."""
        import sys

        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr)

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.close()
