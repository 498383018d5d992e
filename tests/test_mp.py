"""The rank launcher itself (``tests/mp.py``)."""

from __future__ import annotations

import socket

import mp
import pytest
from mp import echo_rank, run_ranks


def test_a_rendezvous_port_taken_meanwhile_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process binds the port between free_port() and rank 0's bind: the ranks
    start again on another port at once (the other ranks used to wait for rank 0's
    store until the timeout, then fail: a 240 s flake in a busy CI)."""
    with socket.create_server(("127.0.0.1", 0)) as busy:
        ports = [busy.getsockname()[1]]
        real = mp.free_port
        monkeypatch.setattr(mp, "free_port", lambda: ports.pop() if ports else real())
        assert run_ranks(echo_rank, 2, timeout=60) == [0, 1]
        assert not ports  # the taken port was tried first
