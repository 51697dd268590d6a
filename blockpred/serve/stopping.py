"""How ``blockpred serve`` ends: every request it took is answered, none is cut off, in one line.

On the first SIGINT or SIGTERM (:class:`StopSignals`; or at the end of
:func:`blockpred.serve.serving`'s block), :func:`stop_serving`:

1. takes the connections the system already accepted for it (the listening
   socket's backlog), then closes the listening sockets: a connection that
   reaches the port from then on is refused, as at any closed port;
2. answers 503 ("the server is stopping") to every request that arrives from
   then on over an open connection, and closes the connection after it;
3. answers 503 to each request that waits for a block not yet in the pipeline
   (the block is withdrawn: it never reaches the device); a request whose block
   is in the pipeline (read, on the device or being written) waits for it and
   is answered as usual, as is one being read from the output or the input;
4. once every answer is sent, closes the connections; the pipeline stops and
   the command says ``blockpred: interrupted`` (exit 130) or ``blockpred:
   terminated (SIGTERM)`` (exit 143), one line.

So a stop waits for the blocks in the pipeline, as an interrupted ``blockpred
run`` does.  A second signal stops the waiting: the requests still waiting for
a block are answered 503 at once, and the signals' own handlers are back (a
third acts at once).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import Callable

import tornado.httpserver
import tornado.iostream

from .http import Replies
from .work import BlockWork, unless_hurried

#: The signals that stop a server: a terminal's Ctrl-C, and what batch systems, Kubernetes and ``kill`` send first.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """SIGINT and SIGTERM while the server runs, noted on its event loop instead of raised wherever the main thread
    is: :attr:`requested` is set on the first, :attr:`hurry` on the second (which also puts the signals' own
    handlers back).  Made in the main thread before the loop runs, for the signals with a Python handler then
    (as :mod:`blockpred.pipeline.interrupts` defers them); elsewhere nothing is noted."""

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.hurry = asyncio.Event()
        #: The first signal's number (None: none came).
        self.signum: int | None = None
        self._handlers: dict[int, Callable] = {}
        if threading.current_thread() is threading.main_thread():
            self._handlers = {signum: handler for signum in STOP_SIGNALS
                              if callable(handler := signal.getsignal(signum))}
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> None:
        """(on the loop) Note the signals from here on."""
        self._loop = asyncio.get_running_loop()
        for signum in self._handlers:
            self._loop.add_signal_handler(signum, self._noted, signum)

    def uninstall(self) -> None:
        """(on the loop, before it closes: closing it would leave the system's handlers) The handlers back."""
        if self._loop is not None:
            for signum, handler in self._handlers.items():
                self._loop.remove_signal_handler(signum)
                signal.signal(signum, handler)
            self._loop = None

    def _noted(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum
            self.requested.set()
        else:
            self.hurry.set()
            self.uninstall()

    def act(self) -> None:
        """(once the server stopped) Raise as the first signal's own handler would have: ``KeyboardInterrupt``, or
        the CLI's :class:`blockpred.errors.Terminated`."""
        if self.signum is not None:
            self._handlers[self.signum](self.signum, None)


def _take_backlog(server: tornado.httpserver.HTTPServer, sockets: list) -> None:
    """Serve the connections the system accepted for the listening ``sockets`` and tornado has not taken yet."""
    for sock in sockets:
        while True:
            try:
                connection, address = sock.accept()
            except ConnectionAbortedError:  # closed by the client while it waited
                continue
            except OSError:  # BlockingIOError: none left (or the socket is closed already)
                break
            server.handle_stream(tornado.iostream.IOStream(connection), address)


async def stop_serving(server: tornado.httpserver.HTTPServer, sockets: list, work: BlockWork, replies: Replies,
                       hurry: asyncio.Event) -> None:
    """Stop the server as the module docstring says; returns when every connection is closed."""
    _take_backlog(server, sockets)
    server.stop()  # closes the listening sockets
    server.conn_params.no_keep_alive = True  # each request read from here on closes its connection after its answer
    await work.stop(hurry)
    if hurry.is_set():  # hurried while the blocks were waited for: the 503s just given are sent before the close
        await replies.all_sent()  # (closing a connection drops what it has not sent; a third signal acts at once)
    else:
        await unless_hurried(replies.all_sent(), hurry)
    await server.close_all_connections()
    work.close()
