"""The address of a running dask scheduler (``--scheduler``): checked before anything starts, and reached at once.

* **Checked first.** :func:`check_scheduler_address` reads the address as
  dask does (its scheme, then the host and port of an IP transport), when
  the run's cluster is set up: a malformed one is one line before the model
  loads, not dask's ``missing port number`` as an unexpected error after it.
* **Reached quickly, or refused in one line.** dask retries a connection for
  ``distributed.comm.timeouts.connect`` (30 s) before it gives up: right for
  a run that reconnects, but a wrong port would wait half a minute and then
  read as a file system error.  :func:`connect` first opens a plain TCP
  connection to the address's host and port: a refused connection (nothing
  listens there) or a host name that does not resolve is one line at once,
  never retried.  Then it shakes hands with the scheduler within
  :data:`FIRST_CONNECT_S` (or dask's timeout, if shorter: a scheduler that is
  slow to answer, a host that drops packets) and says so in one line when
  nothing answers; only then does it open the client, which keeps dask's
  lenient timeout for the rest of the run.

Nothing here imports dask at module level.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import threading

from ..errors import InvalidOptionError
from .distributed_setup import import_distributed, quiet_dask

#: Seconds the first handshake with a scheduler may take (a scheduler being started may need a few of them).
FIRST_CONNECT_S = 10.0

#: The form of an address, as the refusals name it.
_EXPECTED = "a running dask scheduler's address, tcp://HOST:PORT (`dask scheduler` prints it)"


def check_scheduler_address(address: str) -> None:
    """Raise :class:`InvalidOptionError` unless ``address`` is a dask address: a known scheme (``tcp://`` when
    none is named) and, for an IP transport (tcp, tls, ws), a host and a port from 1 to 65535."""
    import_distributed()
    from distributed.comm import parse_address
    from distributed.comm.registry import get_backend

    try:
        scheme, location = parse_address(address)
        backend = get_backend(scheme)
        try:
            _, port = backend.get_address_host_port(location)
        except NotImplementedError:  # a transport without host and port (inproc, ucx): dask's to reach
            return
    except ValueError as err:
        raise InvalidOptionError(f"--scheduler {address!r} is not a dask scheduler address ({err}); "
                                 f"give {_EXPECTED}") from None
    if not 0 < port < 65536:
        raise InvalidOptionError(f"--scheduler {address!r} names port {port}, outside 1-65535; give {_EXPECTED}")


def connect(address: str):
    """A ``distributed.Client`` of the scheduler at ``address``, once it answered a handshake within
    :func:`first_connect_s`; :class:`InvalidOptionError` when it did not (nothing of the run has started)."""
    from distributed import Client

    check_scheduler_address(address)
    reach(address, first_connect_s())
    quiet_dask()
    return Client(address)


def first_connect_s() -> float:
    """:data:`FIRST_CONNECT_S`, or dask's connect timeout (``distributed.comm.timeouts.connect``) when shorter."""
    import_distributed()
    import dask
    from dask.utils import parse_timedelta

    return min(FIRST_CONNECT_S, parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "s"))


def reach(address: str, timeout_s: float) -> None:
    """One handshake with the scheduler at ``address`` within ``timeout_s``, or one line saying none answered.

    The handshake runs on a thread of its own (``asyncio.run`` needs a thread
    without a running event loop, and a notebook's main thread has one); the
    thread is a daemon, so a Ctrl-C meanwhile does not wait for it.
    """
    from distributed.comm import connect as open_comm

    async def handshake() -> None:
        await _listening(address, timeout_s)
        # dask's connect retries for timeout_s; the bound after it is for a peer that accepts and never answers
        comm = await asyncio.wait_for(open_comm(address, timeout=timeout_s), timeout_s + 1.0)
        await comm.close()

    failures: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(handshake())
        except BaseException as err:  # noqa: BLE001 - raised below, in the caller's thread
            failures.append(err)

    thread = threading.Thread(target=run, name="blockpred-scheduler-handshake", daemon=True)
    thread.start()
    thread.join()
    if not failures:
        return
    if isinstance(failures[0], _NotListening):
        raise InvalidOptionError(
            f"no dask scheduler at {address}: {failures[0]}; start one there (`dask scheduler` prints its "
            f"address) or check --scheduler"
        ) from None
    if isinstance(failures[0], OSError):  # dask's "Timed out trying to connect", or asyncio's TimeoutError
        raise InvalidOptionError(
            f"no dask scheduler answered at {address} within {timeout_s:g} s{_reason(failures[0])}; "
            f"start one there (`dask scheduler` prints its address) or check --scheduler"
        ) from failures[0]
    raise failures[0]


class _NotListening(OSError):
    """Nothing listens at the address, or its host has no address: known at the first try, never retried."""


async def _listening(address: str, timeout_s: float) -> None:
    """Open and close a plain TCP connection to the host and port of ``address`` (an IP transport's: tcp, tls, ws);
    raise :class:`_NotListening` when it is refused, the host does not resolve or cannot be reached, and a
    ``TimeoutError`` when nothing answered within ``timeout_s`` (a host that drops the packets)."""
    from distributed.comm import parse_address
    from distributed.comm.registry import get_backend

    scheme, location = parse_address(address)
    try:
        host, port = get_backend(scheme).get_address_host_port(location)
    except NotImplementedError:  # no host and port (inproc, ucx): dask's to reach
        return
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except ConnectionRefusedError:
        raise _NotListening("the connection was refused (nothing listens on that port)") from None
    except socket.gaierror as err:
        raise _NotListening(f"its host {host!r} has no address ({err.strerror})") from None
    except asyncio.TimeoutError:
        raise OSError(errno.ETIMEDOUT, "no answer to a TCP connection") from None
    except OSError as err:  # no route to the host, the network down: known at once too
        raise _NotListening(err.strerror or str(err)) from None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


def _reason(error: BaseException) -> str:
    """What the attempts met, in a few words ("Connection refused", "Name or service not known"), or nothing."""
    if isinstance(error, TimeoutError):  # asyncio's bound, not dask's: something listens there, but not dask
        return " (something accepted the connection but did not answer as a dask scheduler)"
    said = ""
    while error is not None:  # dask's "Timed out trying to connect" wraps the last attempt's error
        said = getattr(error, "strerror", None) or said
        error = error.__cause__
    return f" ({said})" if said else ""
