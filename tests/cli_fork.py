"""A fork server for CLI tests: each ``python -m dcpstore ARGS`` command runs in a fresh
process forked from one that imported torch, dcpstore (and what ``preload`` names) once,
so a command does not pay torch's import (tests/test_cli.py, tests/test_cli_backends.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from types import TracebackType

__all__ = ["ForkedCLI"]

#: The fork server: imports what the commands would (torch, dcpstore and its tools) and
#: the modules named as its arguments, then per request line forks a child that runs
#: ``python -m dcpstore ARGS`` (runpy, as ``-m`` does) with the request's environment,
#: working directory and stdout / stderr files, stdin from /dev/null; the child exits as
#: that interpreter would (non-daemon threads, atexit handlers, exit status, a traceback
#: for an uncaught error). The server answers each request with the child's exit status.
_FORK_SERVER = r"""
import gc, json, os, runpy, sys, threading
import torch, torch.distributed.checkpoint
import dcpstore, dcpstore.tools.cli, dcpstore.tools.ops
for name in sys.argv[1:]:
    __import__(name)
# what the imports made is left out of the collections (a child's exit then does not
# touch, and so copy, every page of it)
gc.freeze()
for line in sys.stdin:
    req = json.loads(line)
    # forking is safe from a process with one thread only (no pool started pre-fork)
    assert threading.active_count() == 1, threading.enumerate()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        break
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
else:
    sys.exit(0)
fd = os.open(os.devnull, os.O_RDONLY)
os.dup2(fd, 0)
os.close(fd)
for target, path in ((1, req["stdout"]), (2, req["stderr"])):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, target)
    os.close(fd)
os.environ.clear()
os.environ.update(req["env"])
os.chdir(req["cwd"])
sys.argv = ["dcpstore", *req["args"]]
runpy.run_module("dcpstore", run_name="__main__", alter_sys=True)
"""


class ForkedCLI:
    """Runs ``python -m dcpstore ARGS`` commands, each in a fresh process forked from a
    server that imported torch, dcpstore and ``preload`` once. ``env``: the environment
    of the server and of every command (default: this process's, as it is at each
    command)."""

    def __init__(self, env: Mapping[str, str] | None = None, preload: tuple[str, ...] = ()
                 ) -> None:
        self._env = None if env is None else dict(env)
        self._tmp = tempfile.mkdtemp(prefix="dcpstore-cli-")
        self._count = 0
        self._proc = subprocess.Popen(  # its own session: close() can end it and its child
            [sys.executable, "-c", _FORK_SERVER, *preload], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=self._env, start_new_session=True)

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """One command in this process's working directory; its exit code, stdout and
        stderr. A command still running after ``timeout`` seconds is killed (with the
        server) and raises :class:`subprocess.TimeoutExpired`."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._count += 1
        out = os.path.join(self._tmp, f"{self._count}.out")
        err = os.path.join(self._tmp, f"{self._count}.err")
        request = {"args": list(args), "env": dict(os.environ if self._env is None else self._env),
                   "cwd": os.getcwd(), "stdout": out, "stderr": err}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        cmd = [sys.executable, "-m", "dcpstore", *args]
        if not select.select([self._proc.stdout], [], [], timeout)[0]:
            self._kill()
            raise subprocess.TimeoutExpired(cmd, timeout)
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the CLI fork server ended (exit {self._proc.wait()})")
        with open(out) as fo, open(err) as fe:
            stdout, stderr = fo.read(), fe.read()
        return subprocess.CompletedProcess(cmd, json.loads(line), stdout, stderr)

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)  # the server and a running command
        self._proc.wait()

    def close(self) -> None:
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):  # the server already ended
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._kill()
        finally:
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> ForkedCLI:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
