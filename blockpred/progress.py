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
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class GuardedStream:
    """A text stream no write to which ever raises: its first failure to write or flush (a full disk, a closed file,
    a terminal gone) is kept in :attr:`failure`, reported once to ``on_failure(stream, error)``, and drops the
    stream.  Anything else (``fileno``, ``isatty``, ``encoding`` ...) is the stream's.  (The ``blockpred``
    command's own stdout and stderr are these too: :mod:`blockpred.process`.)"""

    def __init__(self, stream, name: str = "stderr",
                 on_failure: Callable[[GuardedStream, BaseException], None] | None = None):
        self.wrapped, self.name, self._on_failure = stream, name, on_failure
        self._lock = threading.Lock()
        #: Why the stream was dropped (None while it is written); a stream Python found closed at start is dropped.
        self.failure: BaseException | None = None if stream is not None else ValueError("closed at start")

    def write(self, text: str) -> int:
        if self.failure is None:
            try:
                return self.wrapped.write(text)
            except UnicodeEncodeError:  # a character its encoding lacks is not a failed stream
                encoding = getattr(self.wrapped, "encoding", None) or "ascii"
                return self.write(text.encode(encoding, "replace").decode(encoding))
            except (OSError, ValueError) as err:  # ValueError: a closed file
                self._fail(err)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self.failure is None:
            try:
                self.wrapped.flush()
            except (OSError, ValueError) as err:
                self._fail(err)

    def isatty(self) -> bool:
        return self.failure is None and bool(self.wrapped.isatty())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["wrapped"], name)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = error
        if self._on_failure is not None:
            self._on_failure(self, error)


class ProgressBar:
    """A tqdm bar over blocks with Mvox/s; a no-op when disabled.  Called with (blocks, voxels[, worker])."""

    def __init__(self, num_blocks: int, enabled: bool):
        self._num_blocks = num_blocks
        self._enabled = enabled
        self._bar = None
        self._voxels = 0
        self._first: tuple[float, int] | None = None
        self._lock = threading.Lock()
        self._stream: GuardedStream | None = None

    def __enter__(self):
        if not self._enabled:
            return None
        import sys

        from tqdm.auto import tqdm

        self._stream = GuardedStream(sys.stderr)
        try:
            self._bar = tqdm(total=self._num_blocks, unit="block", desc="blockpred", dynamic_ncols=True,
                             file=self._stream)
        except (OSError, ValueError) as err:
            self._drop(err)
        if self._stream.failure is not None:
            self._drop(self._stream.failure)
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
            if self._bar is not None and self._stream.failure is not None:
                self._drop(self._stream.failure)

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
