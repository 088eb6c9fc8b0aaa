"""The watchdog's store client (strategies.fault_tolerance.job_store): every operation answered or failed in time."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch.distributed as dist

from parallel.host.shm_barrier import proc_stat
from strategies.fault_tolerance.desync import _exchange
from strategies.fault_tolerance.job_store import (
    CONNECT_S,
    BoundedStore,
    StoreUnanswered,
    connect_store,
    host_store,
    serve_store,
)

DEADLINE_S = 0.3
# What the deadline may overrun by: scheduling on a loaded 2-core VM (0.2 s was overrun once in a full
# run on a Zen 3 host). Without the bound, c10d's client waits for good: any finite slack tells them apart.
SLACK_S = 1.0


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped: the signal lands when the process next runs, and on a loaded
    machine its store thread could answer one more request first (a full run saw a stopped host answer)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5.0
    while (proc_stat(pid) or ("?",))[0] != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.001)


class BlockingStore:
    """A store whose ``check`` waits until released: a host that stopped answering, then resumed."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[str] = []

    def check(self, keys: list[str]) -> bool:
        self.calls.append("check")
        self.release.wait()
        return True

    def set(self, key: str, value: str) -> None:
        self.calls.append(f"set {key}")

    def get(self, key: str) -> bytes:
        raise ValueError(f"no key {key}")


_HOST = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
print(server.port, flush=True)
time.sleep(600)
"""


@pytest.fixture
def store_host():
    """A TCP store hosted by another process (as rank 0 hosts it under Lightning's launchers).

    A new interpreter, not a fork: a test leaves a client thread stuck in a call to the stopped host,
    and a fork while it is inside c10d's client could copy a held lock into the child."""
    host = subprocess.Popen([sys.executable, "-c", _HOST], stdout=subprocess.PIPE, text=True)
    port = int(host.stdout.readline())
    yield port, host
    host.kill()
    host.wait()


def test_operations_pass_through_to_a_healthy_store() -> None:
    server = serve_store("127.0.0.1")
    store = BoundedStore(lambda: dist.PrefixStore("job/", server), op_timeout_s=5.0)
    store.set("a", "1")
    assert store.check(["a"]) and not store.check(["b"])
    assert store.get("a") == b"1" and store.multi_get(["a"]) == [b"1"]
    assert store.compare_set("verdict", "", "mine") == b"mine"
    assert store.compare_set("verdict", "", "theirs") == b"mine"  # the first verdict stays


def test_a_value_set_is_there_for_every_other_connection_once_set_returns() -> None:
    """c10d's client sends a set without waiting for an answer: before, a peer reading right after it missed the value
    in about 1 of 300 tries, more under load: a checkpoint was then written without that rank's generators."""
    server = serve_store("127.0.0.1")
    writer = connect_store("127.0.0.1", server.port, "job/", op_timeout_s=30.0)
    reader = dist.PrefixStore("job/", dist.TCPStore("127.0.0.1", server.port, is_master=False))  # reads at once
    missed = []
    for key in (f"k{i}" for i in range(6000)):
        writer.set(key, "1")
        if not reader.check([key]):
            missed.append(key)
    writer.close()
    assert missed == []


def test_a_store_that_does_not_answer_raises_in_time_and_runs_no_abandoned_call() -> None:
    blocking = BlockingStore()
    store = BoundedStore(lambda: blocking, op_timeout_s=DEADLINE_S)  # type: ignore[arg-type,return-value]
    errors: list[BaseException] = []
    stuck = threading.Thread(target=lambda: errors.append(pytest.raises(StoreUnanswered, store.check, ["k"]).value))
    stuck.start()
    time.sleep(0.05)
    sent = time.monotonic()
    with pytest.raises(StoreUnanswered) as queued:  # queued behind the unanswered check: given up
        store.set("late", "1")
    assert time.monotonic() - sent < DEADLINE_S + SLACK_S
    assert queued.value.since < sent  # silent since the check was sent, not since this call
    stuck.join()
    started = time.monotonic()
    with pytest.raises(StoreUnanswered, match="has not answered check"):  # still stuck: raises at once
        store.set("later", "1")
    assert time.monotonic() - started < 0.05
    blocking.release.set()  # the host answers again: once the worker has the answer, calls go through
    deadline = time.monotonic() + 1.0
    while True:
        try:
            store.set("after", "1")
            break
        except StoreUnanswered:  # raised at once, nothing queued: the worker has not read the answer yet
            assert time.monotonic() < deadline
            time.sleep(0.01)
    # The calls given up before they started never ran; a set is confirmed by a check on the same connection.
    assert blocking.calls == ["check", "set after", "check"]
    with pytest.raises(ValueError, match="no key k"):  # the store's own error reaches the caller
        store.get("k")
    assert isinstance(errors[0], StoreUnanswered) and isinstance(errors[0], RuntimeError)


def test_a_stopped_store_host_fails_every_operation_within_the_deadline(store_host) -> None:
    """c10d's own client waits for good on a SIGSTOP'd host (check, get, multi_get), whatever its timeout."""
    port, host = store_host
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=CONNECT_S))
    store = BoundedStore(lambda: dist.PrefixStore("job/", client), op_timeout_s=DEADLINE_S)
    store.set("hb/1", "beat")
    assert store.check(["hb/1"])
    _stop(host.pid)
    for operation, args in (("check", (["hb/1"],)), ("multi_get", (["hb/1"],)), ("get", ("hb/1",))):
        started = time.monotonic()
        with pytest.raises(StoreUnanswered):
            getattr(store, operation)(*args)
        assert time.monotonic() - started < DEADLINE_S + SLACK_S, operation


def test_close_ends_the_worker_thread() -> None:
    before = set(threading.enumerate())
    answering = BlockingStore()
    answering.release.set()
    store = BoundedStore(lambda: answering, op_timeout_s=DEADLINE_S)  # type: ignore[arg-type,return-value]
    store.set("k", "v")
    workers = [thread for thread in set(threading.enumerate()) - before if thread.name == "custom_ddp-store"]
    assert len(workers) == 1
    store.close()
    for thread in workers:
        thread.join(timeout=1.0)
    assert not any(thread.is_alive() for thread in workers)


def test_connecting_to_a_stopped_store_host_fails_within_the_deadline(store_host) -> None:
    """c10d's client constructor waits for good on a SIGSTOP'd host too (measured: still waiting after 60 s)."""
    port, host = store_host
    connect_store("127.0.0.1", port, "job/", op_timeout_s=DEADLINE_S).set("k", "v")  # healthy: connects
    _stop(host.pid)
    started = time.monotonic()
    with pytest.raises(StoreUnanswered, match="has not answered connect"):
        connect_store("127.0.0.1", port, "job/", op_timeout_s=DEADLINE_S, connect_timeout_s=DEADLINE_S)
    assert time.monotonic() - started < DEADLINE_S + SLACK_S


def test_a_connection_that_fails_raises_its_own_error() -> None:
    def refuse() -> dist.Store:
        raise ConnectionRefusedError("no store here")

    with pytest.raises(ConnectionRefusedError, match="no store here"):
        BoundedStore(refuse, op_timeout_s=DEADLINE_S)


def test_the_desync_exchange_gives_up_on_a_stopped_store_host(store_host, monkeypatch) -> None:
    """The desync report's line exchange is bounded too: rank 0 prints its own side instead of hanging."""
    port, host = store_host
    monkeypatch.setattr("strategies.fault_tolerance.desync._STORE_WAIT_S", DEADLINE_S)
    assert _exchange("rank 1: x", 1, 2, "127.0.0.1", port) == ["rank 1: x"]
    assert _exchange("rank 0: y", 0, 2, "127.0.0.1", port) == ["rank 0: y", "rank 1: x"]
    monkeypatch.setattr(
        "strategies.fault_tolerance.desync._CONNECT_WAIT_S", DEADLINE_S
    )  # healthy connections kept CONNECT_S
    _stop(host.pid)
    started = time.monotonic()
    assert _exchange("rank 0: y", 0, 2, "127.0.0.1", port) is None
    assert time.monotonic() - started < DEADLINE_S + SLACK_S


@contextmanager
def held_back(port: int, hold_s: float) -> Iterator[int]:
    """A port in front of the store at ``port`` where each new connection waits ``hold_s`` before the store
    sees it: a store host whose loop is busy with an accepted peer's name lookup."""
    listener = socket.create_server(("127.0.0.1", 0))

    def pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def accept() -> None:
        with contextlib.suppress(OSError):  # the listener closed
            while True:
                client, _ = listener.accept()
                time.sleep(hold_s)
                store = socket.create_connection(("127.0.0.1", port))
                for ends in ((client, store), (store, client)):
                    threading.Thread(target=pump, args=ends, daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()


def test_a_connection_gets_longer_than_a_name_lookup_then_each_operation_its_own_deadline() -> None:
    """A healthy host can take a resolver's timeout to accept (strategies.fault_tolerance.job_store.CONNECT_S); with the
    operation deadline as its connect deadline the client gave up on it, and the watchdog ran without a stall
    watch. Here the store sees the connection 1 s late: it connects; a stalled operation still fails in time."""
    server = serve_store("127.0.0.1")
    with held_back(server.port, hold_s=1.0) as port:
        started = time.monotonic()
        store = connect_store("127.0.0.1", port, "job/", op_timeout_s=DEADLINE_S)
        assert time.monotonic() - started >= 1.0
        store.set("k", "v")
        assert store.get("k") == b"v"
        blocking = BlockingStore()
        slow_ops = BoundedStore(
            lambda: blocking,
            op_timeout_s=DEADLINE_S,  # type: ignore[arg-type,return-value]
            connect_timeout_s=CONNECT_S,
        )
        with pytest.raises(StoreUnanswered, match="has not answered check"):
            slow_ops.check(["k"])
        blocking.release.set()
        slow_ops.close()
        store.close()


def test_a_hosted_store_rides_out_a_slow_connection_to_itself() -> None:
    """The server's own client connection waits on a reverse name lookup on both ends (module docstring of
    strategies.fault_tolerance.job_store); this sandbox's resolver drops one query in 25-50, and with the
    operation timeout (5 s; 2 s here) as its deadline rank 1 then hosted no mirror. 60 servers in a row all start
    now; before, one in 51 failed. (Where the resolver answers every query this passes either way: see the test
    above.)"""
    open_stores: list[BoundedStore] = []
    for _ in range(60):
        store, address = host_store(("127.0.0.1", 1), "test/", op_timeout_s=2.0)
        store.set("key", b"value")
        assert store.get("key") == b"value" and address.startswith("127.0.0.1:")
        open_stores.append(store)
        if len(open_stores) > 4:
            open_stores.pop(0).close()
    for store in open_stores:
        store.close()
