"""The job's TCP store as ``custom_ddp``'s watchdog talks to it: every operation ends within a deadline.

The store (the rendezvous server that Lightning's launchers host in rank 0's process, torchrun's agent
store) carries the heartbeats, the stall verdict and the exit causes. c10d's client does not bound an
operation by its ``timeout`` when the host process is stopped (SIGSTOP, a frozen machine): the kernel
still takes the request's bytes, and ``check``, ``get`` and ``multi_get`` wait for the answer for good
(measured with torch 2.14: still blocked after 40 s with a 5 s timeout). A heartbeat thread blocked
there decides nothing, and a stopped rank 0 hung the whole job (fault matrix row ``sigstop_rank0_train``).

:class:`BoundedStore` connects and runs the client's operations on one worker thread, in call order,
and waits at most ``op_timeout_s`` for each, and ``connect_timeout_s`` for the connection (c10d's
constructor also waits for good on a stopped host, measured above 60 s with a 5 s timeout; a healthy
host can take two name lookups' timeouts, :data:`CONNECT_S`). An operation that does not finish in time raises
:class:`StoreUnanswered`, which says since when the store has not answered; while the worker is
still stuck in it, every further call raises at once (queuing more would only pile up behind it). A
call given up before it started never runs. When the host answers again, the worker goes on.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["CONNECT_S", "STORE_OP_S", "BoundedStore", "StoreUnanswered", "connect_store", "host_store", "serve_store"]

STORE_OP_S = 5.0  # a store operation that takes longer fails (the store's host is stopped or gone)
# A new connection can wait on two reverse name lookups: c10d's client looks up the address it connects to, and
# the server the peer it accepted (on its one loop thread), each a PTR query when /etc/hosts does not answer (it
# never does for the IPv4-mapped IPv6 addresses c10d uses, ::ffff:127.0.0.1 included). A resolver that drops a
# query costs glibc's timeout (5 s, then 10 s for its second try): this sandbox's drops one query in 25-50 and a
# connection took 5.0 s; one that drops every query (measured with a silent local nameserver) made a new process's
# first connection take 20.0 s. So a connection gets longer than that, then ``op_timeout_s`` per operation.
CONNECT_S = 30.0


class StoreUnanswered(RuntimeError):
    """The store's host did not answer an operation within the deadline (stopped, frozen or gone)."""

    def __init__(self, operation: str, since: float) -> None:
        super().__init__(f"the job's store has not answered {operation} for {time.monotonic() - since:.1f} s")
        self.since = since  # time.monotonic() when the unanswered operation was sent


@dataclass(eq=False)
class _Call:
    operation: str
    args: tuple[Any, ...]
    sent: float = field(default_factory=time.monotonic)
    started: float | None = None
    abandoned: bool = False
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class _Lane:
    """What the caller and the worker thread share: the calls in order, and the one running now."""

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.running: _Call | None = None


def _run(store: dist.Store, operation: str, args: tuple[Any, ...]) -> Any:
    """One operation on the client; a ``set`` returns once the server holds the value. c10d's client sends a set
    and reads no answer, so a read on another connection right after it could miss the value (measured: 179 of
    20,000 immediate reads on 2 loaded cores, a checkpoint then written without a peer's generators). The server
    answers one connection's requests in order: a ``check`` on this one returns after the set was applied."""
    if operation != "set":
        return getattr(store, operation)(*args)
    store.set(*args)
    store.check([args[0]])
    return None


def _serve(connect: Callable[[], dist.Store], lane: _Lane) -> None:
    """The worker thread: connects (the first call), then runs the calls in order until ``None``
    arrives (then the client can close)."""
    store: dist.Store | None = None
    while (call := lane.calls.get()) is not None:
        with lane.lock:
            if call.abandoned:
                continue
            call.started, lane.running = time.monotonic(), call
        try:
            if store is None:
                store = call.result = connect()
            else:
                call.result = _run(store, call.operation, call.args)
        except Exception as error:  # noqa: BLE001 - handed to the caller
            call.error = error
        with lane.lock:
            lane.running = None
        call.done.set()


class BoundedStore:
    """The store ``connect()`` returns, made on the worker thread: its ``set``/``get``/``check``/
    ``multi_get``/``compare_set``, each answered or raising :class:`StoreUnanswered` within
    ``op_timeout_s`` (see the module docstring); ``set`` returns once the server holds the value, so any
    connection reads it after that. Thread-safe. The constructor raises what
    ``connect`` raises, or :class:`StoreUnanswered` when it does not return within ``connect_timeout_s``
    (``None``: ``op_timeout_s``)."""

    def __init__(
        self,
        connect: Callable[[], dist.Store],
        op_timeout_s: float = STORE_OP_S,
        connect_timeout_s: float | None = None,
    ) -> None:
        self._timeout = op_timeout_s
        self._lane = _Lane()
        # A daemon thread holding the client, not this object: dropping this object ends it too.
        worker = threading.Thread(target=_serve, args=(connect, self._lane), name="custom_ddp-store", daemon=True)
        worker.start()
        self._close = weakref.finalize(self, self._lane.calls.put, None)
        try:
            self._call("connect", timeout_s=op_timeout_s if connect_timeout_s is None else connect_timeout_s)
        except BaseException:
            self.close()  # the worker ends once the connection returns, if it ever does
            raise

    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def close(self) -> None:
        """Let the worker end once its calls are done: the client's connection closes with it."""
        self._close()

    def _call(self, operation: str, *args: Any, timeout_s: float | None = None) -> Any:
        lane = self._lane
        with lane.lock:
            stuck = lane.running
            if stuck is not None and stuck.started is not None and time.monotonic() - stuck.started >= self._timeout:
                raise StoreUnanswered(stuck.operation, stuck.started)
            call = _Call(operation, args)
            lane.calls.put(call)
        if not call.done.wait(self._timeout if timeout_s is None else timeout_s):
            with lane.lock:
                call.abandoned = True  # skipped if it has not started
                running = lane.running
            # Silent since the call the worker is stuck in was sent: this one, or an earlier one.
            since = min(call.sent, running.started or call.sent) if running is not None else call.sent
            raise StoreUnanswered(operation, since)
        if call.error is not None:
            raise call.error
        return call.result


def connect_store(
    host: str, port: int, prefix: str, op_timeout_s: float = STORE_OP_S, connect_timeout_s: float = CONNECT_S
) -> BoundedStore:
    """A new client connection to the job's TCP store (not the process group's own), keys under ``prefix``;
    raises :class:`StoreUnanswered` when the host does not accept it within ``connect_timeout_s``."""

    def connect() -> dist.Store:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=connect_timeout_s))
        store.set_timeout(timedelta(seconds=op_timeout_s))
        return dist.PrefixStore(prefix, store)

    return BoundedStore(connect, op_timeout_s, connect_timeout_s)


def _address_toward(host: str, port: int) -> str:
    """This machine's address on the route to ``host``: the one a process there reaches it at (no packet is sent)."""
    try:
        family, kind, _, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as probe:
            probe.connect(target)
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()


def serve_store(host: str, op_timeout_s: float = STORE_OP_S) -> dist.TCPStore:
    """A new TCP store server in this process at ``host``, on a free port: its own client connection gets
    :data:`CONNECT_S`, then its operations ``op_timeout_s``."""
    server = dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=max(op_timeout_s, CONNECT_S))
    )
    server.set_timeout(timedelta(seconds=op_timeout_s))
    return server


def host_store(
    reachable_from: tuple[str, int], prefix: str, op_timeout_s: float = STORE_OP_S
) -> tuple[BoundedStore, str]:
    """A new TCP store server in this process, on a free port, keys under ``prefix`` (as :func:`connect_store`
    puts them), as a :class:`BoundedStore` (the server ends when that is closed), and the ``host:port`` at which
    processes that reach ``reachable_from`` (the job's store) reach it."""
    host = _address_toward(*reachable_from)
    server = serve_store(host, op_timeout_s)
    return BoundedStore(lambda: dist.PrefixStore(prefix, server), op_timeout_s), f"{host}:{server.port}"
