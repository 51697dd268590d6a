"""The progress bar of a run: an observer the runner calls as blocks finish.

The bar is auxiliary: where stderr cannot be written (a full disk behind
``2>log``, a terminal gone), the bar ends with one warning and the run goes
on, from the pipeline's threads too (the ``blockpred`` command guards its
streams itself: :mod:`blockpred.process`; this is for callers of
:func:`blockpred.predict`).  tqdm draws on a guarded stream that never raises:
tqdm holds its process-wide lock while it draws and does not release it when
a write raises, and every later bar of the process (a notebook's next run)
would then wait for it forever.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


class _Guarded:
    """A stream whose failed writes are kept (:attr:`error`), never raised to the caller (tqdm)."""

    def __init__(self, stream):
        self._stream = stream
        self.error: BaseException | None = None

    def write(self, text: str) -> int:
        if self.error is None:
            try:
                return self._stream.write(text)
            except (OSError, ValueError) as err:
                self.error = err
        return 0

    def flush(self) -> None:
        if self.error is None:
            try:
                self._stream.flush()
            except (OSError, ValueError) as err:
                self.error = err

    def __getattr__(self, name):  # isatty, fileno, encoding ...: the stream's own
        return getattr(self._stream, name)


class ProgressBar:
    """A tqdm bar over blocks with Mvox/s; a no-op when disabled.  Called with (blocks, voxels[, worker])."""

    def __init__(self, num_blocks: int, enabled: bool):
        self._num_blocks = num_blocks
        self._enabled = enabled
        self._bar = None
        self._voxels = 0
        self._first: tuple[float, int] | None = None
        self._lock = threading.Lock()
        self._stream: _Guarded | None = None

    def __enter__(self):
        if not self._enabled:
            return None
        import sys

        from tqdm.auto import tqdm

        self._stream = _Guarded(sys.stderr)
        try:
            self._bar = tqdm(total=self._num_blocks, unit="block", desc="blockpred", dynamic_ncols=True,
                             file=self._stream)
        except (OSError, ValueError) as err:
            self._drop(err)
        if self._stream.error is not None:
            self._drop(self._stream.error)
        return self._update

    def _update(self, blocks: int, voxels: int, worker: str | None = None) -> None:
        with self._lock:
            if self._bar is None:
                return
            now = time.perf_counter()
            if self._first is None:  # rate from the first finished block: start-up is not throughput
                self._first = (now, voxels)
            self._voxels += voxels
            since, counted = self._first
            try:
                if now > since:
                    rate = (self._voxels - counted) / (now - since) / 1e6
                    self._bar.set_postfix_str(f"{rate:.2f} Mvox/s", refresh=False)
                self._bar.update(blocks)
            except (OSError, ValueError) as err:
                self._drop(err)
            if self._bar is not None and self._stream.error is not None:
                self._drop(self._stream.error)

    def _drop(self, error: BaseException) -> None:
        """No bar from here on, and one warning (which may not be written either: it is logged, not raised)."""
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.disable = True  # tqdm's close would draw the bar once more
        logger.warning("the progress bar cannot be drawn on stderr (%s); the run goes on without it",
                       getattr(error, "strerror", None) or error)

    def write(self, line: str) -> None:
        """``line`` on stderr, above the bar while there is one (a plain print would be drawn over)."""
        import sys

        try:
            if self._bar is not None:
                self._bar.write(line, file=self._stream)
            else:
                print(line, file=sys.stderr)
        except (OSError, ValueError):  # stderr is gone: the line with it
            pass

    def __exit__(self, *exc):
        if self._bar is not None:
            try:
                self._bar.close()
            except (OSError, ValueError):
                pass
