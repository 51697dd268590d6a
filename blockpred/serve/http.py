"""The HTTP side of ``blockpred serve``: tornado, read-only, one tree per served volume.

``GET``/``HEAD`` of ``/<fingerprint>/prediction.zarr/<key>`` and
``/<fingerprint>/raw.zarr/<key>`` answer a zarr key of :class:`~.tree.ServedTree`;
``/<fingerprint>/status.json`` says what the server did; ``/`` says what is
served.  Everything else is 404 (an unknown fingerprint too: a page of an older
run's URL asks again rather than reading stale data), any method but GET, HEAD
and OPTIONS is 405 (tornado's own answer), and a request tornado cannot parse is
its 400.  A block whose network fails is answered 500 for that chunk only.  A
stopping server answers 503 (see :mod:`.stopping`).  A key
is parsed into integers before anything is read (:meth:`~.tree.ServedTree.chunk_key`):
no key reaches a file.

A request must name the server as this machine (``Host: 127.0.0.1``, ``localhost``
or ``::1``) where it listens on this machine only: a page elsewhere whose name
was made to resolve here (DNS rebinding) is refused, 403.  Cross-origin reads are
allowed for the origins named (``--cors-origin``; by
default neuroglancer's public client and, with ``--viewer``, the local one),
never for any origin: a page the user happens to visit must not read the data
through their browser.
"""

from __future__ import annotations

import asyncio
import json
import logging

import tornado.web

from ..errors import BlockFailedError, one_line
from .work import BlockWork, ServerStopping

logger = logging.getLogger(__name__)

#: neuroglancer's public client: a served URL pasted there is read from it.
DEFAULT_ORIGINS = ("https://neuroglancer-demo.appspot.com",)
_TREES = ("prediction", "raw")


class Replies:
    """The requests whose answer is not yet sent in full: a stopping server waits for them before it closes its
    connections.  (tornado makes a handler per request and every handler finishes, answered or not.)"""

    def __init__(self) -> None:
        self.num_open = 0
        self._none_open = asyncio.Event()
        self._none_open.set()

    def opened(self) -> None:
        self.num_open += 1
        self._none_open.clear()

    def sent(self) -> None:
        self.num_open -= 1
        if not self.num_open:
            self._none_open.set()

    async def all_sent(self) -> None:
        await self._none_open.wait()


class _Handler(tornado.web.RequestHandler):
    SUPPORTED_METHODS = ("GET", "HEAD", "OPTIONS")

    def initialize(self, app_state: dict) -> None:
        self.state = app_state
        self._gone: asyncio.Future | None = None
        self._open = True
        app_state["replies"].opened()
        self.clear()  # tornado set the default headers before the state was here: again, with it

    def finish(self, chunk=None):
        try:
            sending = super().finish(chunk)
        except BaseException:
            self._sent()
            raise
        sending.add_done_callback(self._sent)  # sent, or the connection went away
        return sending

    def _sent(self, *_) -> None:
        if self._open:
            self._open = False
            self.state["replies"].sent()

    def set_default_headers(self) -> None:
        origin = self.request.headers.get("Origin")
        if origin is not None and origin in getattr(self, "state", {}).get("origins", ()):
            self.set_header("Access-Control-Allow-Origin", origin)
            self.set_header("Vary", "Origin")
            self.set_header("Access-Control-Allow-Methods", "GET, HEAD, OPTIONS")
            self.set_header("Access-Control-Allow-Headers", "Range, Content-Type")
        self.set_header("X-Content-Type-Options", "nosniff")

    def prepare(self) -> None:
        hosts = self.state["hosts"]
        if hosts is not None and self.request.host_name.lower() not in hosts:
            # A page elsewhere whose name was made to resolve to this machine (DNS rebinding) reads nothing.
            raise tornado.web.HTTPError(403, reason="not a name of this server")
        if self.state["work"].stopping:
            raise tornado.web.HTTPError(503, reason="the server is stopping")

    def options(self, *args) -> None:
        if self.request.headers.get("Access-Control-Request-Private-Network") == "true" \
                and "Access-Control-Allow-Origin" in self._headers:
            self.set_header("Access-Control-Allow-Private-Network", "true")  # Chrome asks before a public page reads
        self.set_status(204)
        self.finish()

    def write_error(self, status_code: int, **kwargs) -> None:  # a short line, never a traceback
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish(f"{status_code} {self._reason}\n")

    def on_connection_close(self) -> None:
        if self._gone is not None and not self._gone.done():
            self._gone.set_result(None)


class IndexHandler(_Handler):
    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(self.state["index"], indent=1) + "\n")

    head = get


class StatusHandler(_Handler):
    def get(self, fingerprint: str) -> None:
        if fingerprint != self.state["fingerprint"]:
            raise tornado.web.HTTPError(404)
        work: BlockWork = self.state["work"]
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(work.counts.as_dict()) + "\n")

    head = get


class KeyHandler(_Handler):
    async def get(self, fingerprint: str, name: str, key: str) -> None:
        work: BlockWork = self.state["work"]
        if fingerprint != self.state["fingerprint"] or name not in _TREES:
            raise tornado.web.HTTPError(404)
        tree = work.trees[name]
        document = tree.document(key)
        if document is not None:
            self.set_header("Content-Type", "application/json")
            self.finish(document)
            return
        chunk = tree.chunk_key(key)
        if chunk is None:
            raise tornado.web.HTTPError(404)
        self._gone = asyncio.get_running_loop().create_future()
        try:
            data = await work.chunk(name, chunk, self._gone)
        except BlockFailedError:
            raise tornado.web.HTTPError(500, reason="the network failed on this block") from None
        except ServerStopping:
            raise tornado.web.HTTPError(503, reason="the server is stopping") from None
        except Exception as err:  # noqa: BLE001 - the pipeline stopped, a read failed: this chunk fails, not the server
            said = self.state["errors_said"]
            if one_line(err) not in said:  # each error once, not once per chunk
                said.add(one_line(err))
                logger.error("serving %s/%s failed: %s", name, key, one_line(err))
            raise tornado.web.HTTPError(500, reason="this chunk could not be made") from None
        if self._gone.done():
            return  # the request went away: nothing to answer
        if data is None:
            raise tornado.web.HTTPError(404)
        self.set_header("Content-Type", "application/octet-stream")
        self.set_header("Cache-Control", "public, max-age=31536000, immutable")  # the URL names the run
        if self.request.method == "HEAD":
            self.set_header("Content-Length", str(len(data)))
            self.finish()
        else:
            self.finish(data)

    head = get


#: The names a request to a server on this machine only may use (its Host header); others are refused.
LOCAL_NAMES = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def make_app(work: BlockWork, fingerprint: str, index: dict, origins: tuple[str, ...], replies: Replies,
             local_only: bool = True) -> tornado.web.Application:
    """``local_only``: the server listens on this machine only, and a request must name it so; ``replies`` counts
    the answers not yet sent."""
    state = {"work": work, "fingerprint": fingerprint, "index": index, "origins": frozenset(origins),
             "hosts": LOCAL_NAMES if local_only else None, "errors_said": set(), "replies": replies}
    return tornado.web.Application([
        (r"/", IndexHandler, {"app_state": state}),
        (r"/([0-9a-f]+)/status\.json", StatusHandler, {"app_state": state}),
        (r"/([0-9a-f]+)/(prediction|raw)\.zarr/(.*)", KeyHandler, {"app_state": state}),
    ], default_handler_class=_NotFound, default_handler_args={"app_state": state}, compress_response=False,
        serve_traceback=False, log_function=_log)


class _NotFound(_Handler):
    def prepare(self) -> None:
        super().prepare()
        if self.request.method == "OPTIONS":
            return
        raise tornado.web.HTTPError(404)

    def get(self, *args) -> None:  # pragma: no cover - prepare answered
        raise tornado.web.HTTPError(404)

    head = get


def _log(handler: tornado.web.RequestHandler) -> None:
    """Requests at DEBUG (a viewer asks hundreds a second); 5xx at WARNING, but for a stopping server's 503."""
    status = handler.get_status()
    level = logging.WARNING if status >= 500 and status != 503 else logging.DEBUG
    logger.log(level, "%d %s %s %.1f ms", status, handler.request.method, handler.request.uri,
               1000 * handler.request.request_time())
