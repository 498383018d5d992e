"""Shared store clients (:mod:`dcpstore.storage.clients`) and learnt concurrency limits
(:class:`dcpstore.storage.concurrency.LearntLimits`).

What this file proves:

- the cache hands one client per key to every user, keeps a released one open while it
  is among the last idle ones and closes older idle ones, gives a cleared client back to
  its user to close, and a forked child starts without its parent's clients;
- S3 backends with the same options and ``AWS_*`` environment share one botocore client
  (made once per process), a changed environment or option gets another, and ``close``
  leaves the shared client usable by the next backend;
- a new backend on the same store starts its upload limit where the last one settled,
  and reads start at the ceiling.

Assertions count clients made and closed, and limits; never time.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from stores import Store

import dcpstore
from dcpstore.storage.backend import ReadRange
from dcpstore.storage.clients import SharedClients, shared_clients
from dcpstore.storage.concurrency import ConcurrencyLimit, LearntLimits

MiB = 1024 * 1024


class _Client:
    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False


def _cache(idle: int = 2) -> tuple[SharedClients, list[str], list[str]]:
    made: list[str] = []
    closed: list[str] = []
    return SharedClients(idle=idle), made, closed


def test_one_client_per_key_counted_and_idle_ones_evicted_oldest_first() -> None:
    cache, made, closed = _cache(idle=2)

    def acquire(key: str) -> Any:
        return cache.acquire(key, lambda: made.append(key) or _Client(key),
                             lambda c: closed.append(c.name))

    a1, a2 = acquire("a"), acquire("a")
    assert a1 is a2 and made == ["a"] and cache.made == 1
    assert cache.release("a", a1) and closed == []  # one user left
    assert cache.release("a", a2) and closed == []  # idle, still open
    assert acquire("a") is a1 and made == ["a"]  # reused, connections and all
    assert cache.release("a", a1)
    for key in "bcd":  # three more idle clients: the two oldest idle ones are closed
        cache.release(key, acquire(key))
    assert closed == ["a", "b"] and len(cache) == 2
    assert not cache.release("a", a1)  # no longer known: its user closes it


def test_clear_closes_idle_clients_and_hands_busy_ones_back() -> None:
    cache, _, closed = _cache()
    busy = cache.acquire("busy", lambda: _Client("busy"), lambda c: closed.append(c.name))
    idle = cache.acquire("idle", lambda: _Client("idle"), lambda c: closed.append(c.name))
    cache.release("idle", idle)
    cache.clear()
    assert closed == ["idle"] and len(cache) == 0
    assert cache.release("busy", busy) is False  # the backend closes it itself


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_use_its_parents_clients() -> None:
    cache, _, _ = _cache()
    parent = cache.acquire("k", lambda: _Client("parent"), lambda c: None)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a client of its own
        child = cache.acquire("k", lambda: _Client("child"), lambda c: None)
        os.write(write, child.name.encode())
        os._exit(0)
    os.close(write)
    assert os.read(read, 16) == b"child"
    os.waitpid(pid, 0)
    assert cache.acquire("k", lambda: _Client("again"), lambda c: None) is parent


def test_learnt_limits_are_kept_per_store_and_direction() -> None:
    learnt = LearntLimits()
    limit = ConcurrencyLimit(8)
    learnt.remember("store", "upload", limit)
    assert learnt.recall("store", "upload") is None  # it decided nothing yet
    with limit._cond:  # as a window that grew would
        limit._set(6, "grow", 1.0, 0.0)
    learnt.remember("store", "upload", limit)
    assert learnt.recall("store", "upload") == 6
    assert learnt.recall("store", "read") is None and learnt.recall("other", "upload") is None
    fixed = ConcurrencyLimit(8, adaptive=False)
    learnt.remember("store", "read", fixed)
    assert learnt.recall("store", "read") is None


@pytest.mark.parametrize("store", ["seaweedfs"], indirect=True)
def test_s3_backends_share_one_client_per_settings_and_environment(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    shared_clients.clear()
    made = shared_clients.made
    first = store.backend(store.uri("shared"))
    second = store.backend(store.uri("shared"))
    first.put("a", b"1")
    second.put("b", b"2")
    assert first.client is second.client and shared_clients.made == made + 1
    client = first.client
    first.close()
    second.close()
    third = store.backend(store.uri("shared"))
    third.put("c", b"3")  # the closed backends' client, still open
    assert third.client is client and shared_clients.made == made + 1
    other = dcpstore.open_backend(store.uri("shared"), **{**store.options, "timeout": 7.0})
    assert other.client is not client  # other settings: another client
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # another environment: another client
    env = store.backend(store.uri("shared"))
    assert env.client is not client and env.client is not other.client
    assert shared_clients.made == made + 3
    for backend in (third, other, env):
        backend.close()


@pytest.mark.parametrize("store", ["seaweedfs"], indirect=True)
def test_a_new_backend_starts_where_the_last_one_on_the_store_settled(store: Store) -> None:
    opts = {**store.options, "part_size": 5 * MiB, "multipart_threshold": 5 * MiB,
            "max_concurrency": 6}
    first = dcpstore.open_backend(store.uri("learnt"), **opts)
    payload = os.urandom(30 * MiB)
    try:
        for i in range(3):  # rounds of 6 parts: windows for the upload limit to decide on
            with first.open_upload(f"obj{i}") as up:
                up.write(payload)
                up.commit()
        assert first.concurrency_figures()["upload"]["decisions"]  # it decided something
        gate = first._concurrency("upload")
        with gate._cond:  # where it settled, made unmistakable (neither 2 nor the ceiling)
            gate._set(5, "probe", 1.0, 0.0)
        # reads start at the ceiling, with no slow start
        reads = [ReadRange("obj0", i * MiB, MiB) for i in range(12)]
        got = dict(first.read_ranges(reads))
        assert bytes(got[3]) == payload[3 * MiB:4 * MiB]
        assert first.concurrency_figures()["read"]["highest"] == 6
    finally:
        first.close()
    second = dcpstore.open_backend(store.uri("learnt"), **opts)
    try:
        assert second._concurrency("upload").limit == 5
        assert second._concurrency("read").limit >= 1
        fresh = dcpstore.open_backend(store.uri("learnt"), **{**opts, "max_concurrency": 5})
        # another ceiling is another client key: nothing learnt, uploads start at 2,
        # reads at the ceiling
        assert fresh._concurrency("upload").limit == 2
        assert fresh._concurrency("read").limit == 5
        fresh.close()
    finally:
        second.close()
