"""``blockpred serve``: a prediction served to a viewer as it is asked for, block by block, exact and cached.

:func:`serve` opens the run (:mod:`.session`: the checks, plan, lock and output of
``blockpred run``), serves its prediction and its input as OME-NGFF zarr trees
(:mod:`.tree`) over HTTP (:mod:`.http`), predicts a block when a chunk of it
is first asked for (:mod:`.work`), and stops, on SIGINT or SIGTERM, with every
request it took answered (:mod:`.stopping`).  :func:`serving` does the same on a
thread of its own and returns at once (a notebook, a test).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..errors import InvalidOptionError
from .http import DEFAULT_ORIGINS, Replies, make_app

#: Addresses of this machine only: a server there answers requests that name it so (see :mod:`.http`).
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
from .session import Session, open_session
from .stopping import StopSignals, stop_serving
from .tree import ServedTree
from .work import BlockWork

logger = logging.getLogger(__name__)

__all__ = ["Served", "serve", "serving"]


@dataclass
class Served:
    """A running server: where it is and what it serves."""

    host: str
    port: int
    fingerprint: str
    session: Session
    work: BlockWork
    #: A neuroglancer link (with the neuroglancer package), else None.
    neuroglancer: str | None = None

    @property
    def base(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/{self.fingerprint}"

    @property
    def prediction_url(self) -> str:
        return f"{self.base}/prediction.zarr"

    @property
    def raw_url(self) -> str:
        return f"{self.base}/raw.zarr"

    @property
    def status_url(self) -> str:
        return f"{self.base}/status.json"

    def index(self) -> dict:
        return {"prediction": self.prediction_url, "raw": self.raw_url, "status": self.status_url,
                "neuroglancer": self.neuroglancer, "block": list(self.work.plan.block_shape),
                "output": None if self.session.temporary else str(self.session.target_path)}


def _listen(host: str, port: int) -> list:
    """The server's sockets, bound before the run is opened: a port in use is said at once, in one line."""
    import tornado.netutil

    try:
        return tornado.netutil.bind_sockets(port, address=host)
    except OSError as err:
        raise InvalidOptionError(f"cannot listen on {host}:{port} ({err.strerror or err}); choose another --port "
                                 f"(0: any free one) or --host") from None


async def _start(session: Session, sockets: list, host: str, cache_mb: float, origins: tuple[str, ...],
                 link: Callable[["Served"], str | None] | None) -> tuple[Served, Any, Replies]:
    import tornado.httpserver

    plan = session.job.plan
    source, sink = session.input_volume, session.output_volume
    prediction = ServedTree(source.spatial_shape, sink.num_channels, sink.dtype, plan.block_shape, source.voxel_size)
    raw = ServedTree(source.spatial_shape, source.num_channels, source.dtype, plan.block_shape, source.voxel_size)
    work = BlockWork(plan=plan, stream=session.stream.stream, finished=session.job.markers.finished(),
                     prediction=prediction, raw=raw, read_output=session.read_output, read_input=session.read_input,
                     cache_bytes=int(cache_mb * 2**20))
    served = Served(host, sockets[0].getsockname()[1], session.fingerprint, session, work)
    if link is not None:
        served.neuroglancer = link(served)
    replies = Replies()
    server = tornado.httpserver.HTTPServer(make_app(work, session.fingerprint, served.index(), origins, replies,
                                                    local_only=host in LOCAL_HOSTS))
    server.add_sockets(sockets)
    return served, server, replies


def serve(input, output=None, *, config=None, host: str = "127.0.0.1", port: int = 8000, cache_mb: float = 256,
          cors_origins: tuple[str, ...] = DEFAULT_ORIGINS, on_ready: Callable[[Served], None] | None = None,
          link: Callable[[Served], str | None] | None = None, **options: Any) -> None:
    """Serve the prediction of ``input`` (into ``output``, else a temporary one) until interrupted.

    ``options`` are :func:`blockpred.predict`'s.  ``on_ready(served)`` once the server listens; ``link(served)``
    makes :attr:`Served.neuroglancer`.  SIGINT or SIGTERM stops it as :mod:`.stopping` says, then raises as its
    handler would (``KeyboardInterrupt``).
    """
    sockets = _listen(host, port)
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [sock.close() for sock in sockets])
        session = stack.enter_context(open_session(input, output, config, options))
        signals = StopSignals()

        async def main() -> None:
            signals.install()
            try:
                served, server, replies = await _start(session, sockets, host, cache_mb, tuple(cors_origins), link)
                try:
                    if on_ready is not None:
                        on_ready(served)
                    await signals.requested.wait()
                finally:
                    await stop_serving(server, sockets, served.work, replies, signals.hurry)
            finally:
                signals.uninstall()

        asyncio.run(main())
        signals.act()  # the pipeline stops and the run's output is closed as this unwinds


@contextlib.contextmanager
def serving(input, output=None, *, config=None, host: str = "127.0.0.1", port: int = 0, cache_mb: float = 256,
            cors_origins: tuple[str, ...] = DEFAULT_ORIGINS, **options: Any) -> Iterator[Served]:
    """:func:`serve` on a thread of its own: the running server, stopped when the block ends (``port`` 0: any)."""
    ready: dict = {}
    started = threading.Event()
    sockets = _listen(host, port)
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [sock.close() for sock in sockets])
        session = stack.enter_context(open_session(input, output, config, options))
        loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                ready["served"], ready["server"], ready["replies"] = loop.run_until_complete(
                    _start(session, sockets, host, cache_mb, tuple(cors_origins), None))
            except BaseException as err:  # noqa: BLE001 - raised by the caller's thread
                ready["error"] = err
                started.set()
                return
            started.set()
            loop.run_forever()

        thread = threading.Thread(target=run, name="blockpred-serve", daemon=True)
        thread.start()
        started.wait()
        if "error" in ready:
            raise ready["error"]
        try:
            yield ready["served"]
        finally:
            async def stop() -> None:
                await stop_serving(ready["server"], sockets, ready["served"].work, ready["replies"], asyncio.Event())

            try:
                asyncio.run_coroutine_threadsafe(stop(), loop).result()
            finally:
                loop.call_soon_threadsafe(loop.stop)
                thread.join()
                loop.close()
