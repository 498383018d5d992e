"""Stopping a stand-in server started in its own session (``start_new_session=True``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

__all__ = ["stop_process_group"]


def stop_process_group(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    """Stop ``proc`` and every process in its group (it leads its own session: a server
    and the children it started): SIGTERM, then SIGKILL if it has not exited within
    ``timeout`` seconds. Nothing happens if it has already exited."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout)
