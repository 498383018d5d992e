"""The one rank launcher of the tests: run a function on N torch.distributed ranks (gloo on
the CPU by default, NCCL for the GPU suite; 127.0.0.1).

- :func:`run_ranks` returns each rank's value and raises with every failing rank's
  traceback (the common case);
- :func:`run_killable` is the same launch for ranks that may SIGKILL themselves (crash
  tests): it returns a :class:`LaunchResult` with exit codes, per-rank results and the
  victim's record, and kills survivors ``victim_grace`` seconds after a rank died.

Ranks are forked from a forkserver that has torch and dcpstore imported already (a rank
starts in a fraction of a second instead of re-importing torch). Each rank gets the
environment the caller chose (its own ``os.environ`` by default, for :func:`run_ranks`),
not the forkserver's, which is older. After a clean finish a rank leaves with
``os._exit(0)``: no interpreter teardown, which gloo can abort in.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dcpstore.testing.servers import free_port, scrubbed_environ

__all__ = ["LaunchResult", "echo_rank", "free_port", "run_killable", "run_ranks"]


@dataclass
class LaunchResult:
    """What a launch left behind.

    Attributes:
        exitcodes: Exit code per rank (``-9``: SIGKILL).
        results: Per rank that finished on its own: ``{"status", "value" | "error"}``.
        crash: The victim's record (``crash.json`` in the output directory, see
            ``crash_workers.Tripwire.die``), ``None`` if none died.
        killed_survivors: Ranks the launcher had to SIGKILL after the victim died.
        seconds: Wall time of the launch.
        timed_out: Whether the launch ran past its timeout (every rank was killed).
    """

    exitcodes: list[int | None]
    results: dict[int, dict[str, Any]]
    crash: dict[str, Any] | None
    killed_survivors: list[int]
    seconds: float
    timed_out: bool = False


def _write_result(path: str, obj: Any) -> None:
    """Write ``obj`` to ``path`` atomically: the launcher may SIGKILL a survivor while it
    writes its result, and must then find no file rather than half of one."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(obj, f)
    os.replace(tmp, path)


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any],
           args: tuple[Any, ...], environ: dict[str, str], outdir: str,
           gloo_timeout: float, barrier: bool, backend: str = "gloo") -> None:
    os.environ.clear()  # the forkserver's environment is older than the caller's
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # ranks share the machine's cores
    with open(os.path.join(outdir, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    result: dict[str, Any]
    try:
        if backend == "nccl":  # one GPU per rank, as torchrun's LOCAL_RANK would give
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=gloo_timeout))
        result = {"status": "ok", "value": fn(rank, world_size, *args)}
        if barrier:
            dist.barrier()  # no rank tears gloo down while another still talks to it
    except BaseException as exc:
        if not dist.is_initialized() and "EADDRINUSE" in str(exc):
            # another process took the port between free_port() and this bind: the
            # launcher starts the ranks again on another one
            open(os.path.join(outdir, _PORT_TAKEN), "w").close()
            os._exit(0)
        result = {"status": "error",
                  "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    try:
        _write_result(os.path.join(outdir, f"rank{rank}.pkl"), result)
    except Exception as exc:  # a value that does not pickle
        _write_result(os.path.join(outdir, f"rank{rank}.pkl"),
                      {"status": "error", "error": f"result not picklable: {exc!r}"})
    # no interpreter teardown: a dead peer can make gloo's destructor block or abort
    os._exit(0)


_CONTEXT: Any = None
# installed packages only: the forkserver does not see the tests' sys.path
# (torch._dynamo: DTensor.from_local imports it, seconds per rank otherwise)
_PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.tensor",
            "torch._dynamo", "dcpstore", "dcpstore_s3", "botocore.session", "dcpstore_azure"]


def preload(modules: list[str]) -> None:
    """Import ``modules`` once in the forkserver, not in every rank (a trainer that takes
    seconds to import). Call it at a test module's import, before its first launch."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)
    if _CONTEXT is not None:
        _CONTEXT.set_forkserver_preload(list(_PRELOAD))


def _context() -> Any:
    """The forkserver context, its server preloaded with torch and dcpstore."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(_PRELOAD))
        _CONTEXT = ctx
    return _CONTEXT


#: Written by rank 0 when the rendezvous port was taken meanwhile (see :func:`_launch`).
_PORT_TAKEN = "port-taken"
#: Launches on a fresh port before a taken port counts as a failure.
_PORT_TRIES = 3


def _launch(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], *, outdir: str,
            environ: dict[str, str], victim_grace: float, gloo_timeout: float,
            timeout: float, barrier: bool, backend: str = "gloo") -> LaunchResult:
    """Start the ranks and wait for them (see :func:`run_killable`); start them again on
    another port when the one :func:`free_port` chose was taken before rank 0 bound it
    (the other ranks would wait for it until the timeout)."""
    os.makedirs(outdir, exist_ok=True)
    for _ in range(_PORT_TRIES - 1):
        result = _launch_once(fn, world_size, args, outdir=outdir, environ=environ,
                              victim_grace=victim_grace, gloo_timeout=gloo_timeout,
                              timeout=timeout, barrier=barrier, backend=backend)
        taken = os.path.join(outdir, _PORT_TAKEN)
        if not os.path.exists(taken):
            return result
        os.unlink(taken)
        for name in os.listdir(outdir):
            if name.startswith(("rank", "pid")):
                os.unlink(os.path.join(outdir, name))
    return _launch_once(fn, world_size, args, outdir=outdir, environ=environ,
                        victim_grace=victim_grace, gloo_timeout=gloo_timeout,
                        timeout=timeout, barrier=barrier, backend=backend)


def _launch_once(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], *,
                 outdir: str, environ: dict[str, str], victim_grace: float,
                 gloo_timeout: float, timeout: float, barrier: bool,
                 backend: str = "gloo") -> LaunchResult:
    ctx = _context()
    port = free_port()
    started = time.monotonic()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, environ, outdir,
                                              gloo_timeout, barrier, backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    died_at: float | None = None
    killed: list[int] = []
    timed_out = False
    try:
        while any(p.exitcode is None for p in procs):
            now = time.monotonic()
            if os.path.exists(os.path.join(outdir, _PORT_TAKEN)):
                break  # the finally kills the ranks waiting for rank 0's store
            if now - started > timeout:
                timed_out = True
                break
            if died_at is None and any(p.exitcode is not None and p.exitcode < 0
                                       for p in procs):
                died_at = now
            if died_at is not None and now - died_at >= victim_grace:
                for rank, p in enumerate(procs):
                    if p.exitcode is None:
                        p.kill()
                        killed.append(rank)
                for p in procs:
                    p.join(10)
                break
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join(10)
    results = {}
    for rank in range(world_size):
        path = os.path.join(outdir, f"rank{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                results[rank] = pickle.load(f)
    crash = None
    record = os.path.join(outdir, "crash.json")
    if os.path.exists(record):
        import json

        with open(record) as f:
            crash = json.load(f)
    return LaunchResult([p.exitcode for p in procs], results, crash, killed,
                        time.monotonic() - started, timed_out)


def run_killable(fn: Callable[..., Any], world_size: int, *args: Any, outdir: str,
                 victim_grace: float = 0.0, env: dict[str, str] | None = None,
                 gloo_timeout: float = 15.0, timeout: float = 180.0) -> LaunchResult:
    """Run ``fn(rank, world_size, *args)`` on gloo ranks, one of which may SIGKILL itself.

    Each rank's environment is the caller's without any ``AWS_*`` / ``DCPSTORE_*`` /
    ``MSC_*`` variable, plus ``env``. Once a rank has died by a signal, the others get
    ``victim_grace`` seconds to finish on their own (they see gloo errors), then they
    are SIGKILLed. A launch that runs past ``timeout`` is killed and raises
    ``TimeoutError``.
    """
    result = _launch(fn, world_size, args, outdir=outdir,
                     environ=scrubbed_environ(extra=env), victim_grace=victim_grace,
                     gloo_timeout=gloo_timeout, timeout=timeout, barrier=False)
    if result.timed_out:
        raise TimeoutError(f"ranks still running after {timeout:.0f}s")
    return result


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout: float = 240, backend: str = "gloo") -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks, with the caller's
    environment, over a ``backend`` process group (``"nccl"``: rank ``r`` on GPU
    ``r % device_count``).

    Returns the per-rank return values; raises with each failing rank's traceback.
    """
    with tempfile.TemporaryDirectory(prefix="dcpstore-ranks-") as outdir:
        result = _launch(fn, world_size, args, outdir=outdir, environ=dict(os.environ),
                         victim_grace=0.0, gloo_timeout=timeout, timeout=timeout,
                         barrier=True, backend=backend)
    out = result.results
    errors = [f"rank {r}: {v['error']}" for r, v in sorted(out.items())
              if v["status"] == "error"]
    missing = [r for r in range(world_size) if r not in out]
    if errors or missing:
        raise AssertionError("\n".join(errors + [f"rank {r} died or hung" for r in missing]))
    return [out[r]["value"] for r in range(world_size)]


def echo_rank(rank: int, world_size: int) -> int:
    """A rank function for the launcher's own tests: the rank, once every rank is up."""
    dist.barrier()
    return rank
