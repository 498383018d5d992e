"""Peer replication of a node-local tier: each host's files of a step copied to other
hosts, over the job's own process group, so that a restart after losing a host reads
that host's files from a peer instead of the root.

Which ranks share a disk is :func:`~dcpstore.training.host_tier.host_id`'s answer. Hosts
are ordered by their lowest rank; each rank sends the data files it wrote to one rank on
each of the next ``replicas`` hosts (the rank at its own position there), so no two
copies of a file share a host and every host receives about what it sends. The bytes
travel as ``uint8`` tensors, point to point on the Checkpointer's background gloo group,
in chunks of :data:`CHUNK` bytes: every rank runs the same rounds, and a rank whose disk
refuses a copy keeps receiving (nobody waits on it) and reports it at the end. A copy
lands under a temporary name and takes its real name only once its size and CRC32C match
the manifest, so a step directory never holds half a replica under a data file's name.
Replicas live in the step's directory: retention deletes them with the step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

from dcpstore.dcp.checksum import crc32c
from dcpstore.dcp.dist import is_distributed
from dcpstore.dcp.manifest import Manifest
from dcpstore.errors import DcpstoreError
from dcpstore.training.collectives import Collectives
from dcpstore.training.host_tier import first_ranks, host_id
from dcpstore.training.local_tier import local_record, rank_files

__all__ = ["CHUNK", "Replicated", "ReplicationError", "peers", "replicate_step"]

logger = logging.getLogger(__name__)

#: Bytes per message: each rank holds one chunk it sends and one per host it receives from.
CHUNK = 16 << 20


class ReplicationError(DcpstoreError):
    """Copying a step's files to another host failed (its disk full, say). The step stays
    committed in the local tier and drains to the root as usual; only the copy is
    missing, so losing the host that holds the original means reading the root."""


@dataclass
class Replicated:
    """What one rank's replication of a step did."""

    step: int = -1
    files_sent: int = 0
    bytes_sent: int = 0
    files_received: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


def peers(hosts: list[str], rank: int, replicas: int) -> list[int]:
    """The ranks that ``rank`` sends its files to.

    Args:
        hosts: Every rank's host id, in rank order.
        rank: The sender.
        replicas: Copies wanted on other hosts (capped at the number of other hosts).
    """
    order = list(first_ranks(hosts))
    ranks_of = {h: [r for r, x in enumerate(hosts) if x == h] for h in order}
    mine = order.index(hosts[rank])
    position = ranks_of[hosts[rank]].index(rank)
    out = []
    for k in range(1, min(replicas, len(order) - 1) + 1):
        there = ranks_of[order[(mine + k) % len(order)]]
        out.append(there[position % len(there)])
    return out


def _chunks(step_path: str, files: list[tuple[str, int]]) -> Iterator[bytes]:
    """The concatenated bytes of ``files``, in :data:`CHUNK` pieces."""
    pending = b""
    for name, _ in files:
        with open(os.path.join(step_path, name), "rb") as f:
            while block := f.read(CHUNK - len(pending)):
                pending += block
                if len(pending) == CHUNK:
                    yield pending
                    pending = b""
    if pending:
        yield pending


class _Sink:
    """Writes one sender's stream into its files (temporary names until checked)."""

    def __init__(self, step_path: str, files: list[tuple[str, int]],
                 manifest: Manifest | None) -> None:
        self.step_path, self.files, self.manifest = step_path, list(files), manifest
        self.index, self.written, self.crc = 0, 0, 0
        self.out: BinaryIO | None = None
        self.error: str | None = None
        self.done = 0

    def _tmp(self, name: str) -> str:
        return os.path.join(self.step_path, f"{name}.replica.tmp")

    def write(self, data: memoryview) -> None:
        at = 0
        while at < len(data):
            name, size = self.files[self.index]
            n = min(size - self.written, len(data) - at)
            if self.error is None:
                try:
                    if self.out is None:
                        self.out = open(self._tmp(name), "wb")  # noqa: SIM115 (closed below)
                    self.out.write(data[at : at + n])
                    self.crc = crc32c(data[at : at + n], self.crc)
                except OSError as exc:
                    self.error = f"{self.step_path}/{name}: {exc}"
                    self._drop(name)
            at += n
            self.written += n
            if self.written == size:
                self._finish(name, size)

    def _finish(self, name: str, size: int) -> None:
        if self.error is None and self.out is not None:
            try:
                self.out.flush()
                os.fsync(self.out.fileno())
                self.out.close()
                self.out = None
                rec = self.manifest.files.get(name) if self.manifest else None
                if rec is None or rec.size != size or rec.crc32c != self.crc:
                    self.error = (f"{self.step_path}/{name}: the copy does not match the "
                                  "step's manifest")
                    self._drop(name)
                else:
                    os.replace(self._tmp(name), os.path.join(self.step_path, name))
                    self.done += 1
            except OSError as exc:
                self.error = f"{self.step_path}/{name}: {exc}"
                self._drop(name)
        self.index, self.written, self.crc = self.index + 1, 0, 0

    def _drop(self, name: str) -> None:
        if self.out is not None:
            with contextlib.suppress(OSError):
                self.out.close()
            self.out = None
        with contextlib.suppress(OSError):
            os.unlink(self._tmp(name))


def replicate_step(step: int, step_path: str, collectives: Collectives, group: Any,
                   replicas: int) -> Replicated:
    """Copy every rank's files of the local step ``step_path`` to ``replicas`` other hosts
    (collective over ``group``; every rank must call it).

    Returns:
        What this rank sent and received. Errors (a receiving disk full, a copy that does
        not match the manifest) are in ``errors`` on every rank, logged, and leave the
        local commit as it was.
    """
    started = time.perf_counter()
    done = Replicated(step=step)
    if not is_distributed() or replicas < 1:
        return done
    tier = os.path.dirname(os.path.abspath(step_path))
    rank = collectives.rank(group)
    mine = rank_files(step_path, rank)
    views = collectives.all_gather((host_id(tier), mine), group)
    hosts = [h for h, _ in views]
    plans: list[list[tuple[str, int]]] = [p for _, p in views]
    if len(set(hosts)) < 2:
        return done  # one host, or a shared filesystem: nothing to copy
    targets = {r: peers(hosts, r, replicas) for r in range(len(hosts))}
    sources = [r for r in range(len(hosts)) if rank in targets[r]]
    manifest = local_record(step_path) if sources else None
    sinks = {s: _Sink(step_path, plans[s], manifest) for s in sources}
    rounds = [-(-sum(size for _, size in plan) // CHUNK) for plan in plans]
    outgoing = _chunks(step_path, mine)
    read_error: str | None = None
    for index in range(max(rounds, default=0)):
        ops = []
        if index < rounds[rank]:
            try:
                payload = torch.frombuffer(bytearray(next(outgoing)), dtype=torch.uint8)
            except (OSError, StopIteration) as exc:  # a vanished file: send what it had
                read_error = read_error or f"{step_path}: {exc!r}"
                left = sum(size for _, size in mine) - index * CHUNK
                payload = torch.zeros(min(CHUNK, left), dtype=torch.uint8)
            for peer in targets[rank]:
                ops.append(dist.P2POp(dist.isend, payload, group=group, group_peer=peer))
                done.bytes_sent += payload.numel()
        inbox = {}
        for source in sources:
            if index < rounds[source]:
                left = sum(size for _, size in plans[source]) - index * CHUNK
                inbox[source] = torch.empty(min(CHUNK, left), dtype=torch.uint8)
                ops.append(dist.P2POp(dist.irecv, inbox[source], group=group,
                                      group_peer=source))
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
        for source, buf in inbox.items():
            done.bytes_received += buf.numel()
            sinks[source].write(buf.numpy().data.cast("B"))
    done.files_sent = len(mine) * len(targets[rank])
    done.files_received = sum(s.done for s in sinks.values())
    mistakes = [e for e in [read_error, *(s.error for s in sinks.values())] if e]
    everyone = collectives.all_gather(mistakes, group)
    done.errors = [f"rank {r} (host {hosts[r]}): {e}" for r, errs in enumerate(everyone)
                   for e in errs]
    done.seconds = time.perf_counter() - started
    if done.errors:
        logger.error("replicating step %d to other hosts failed: %s. The step stays "
                     "committed locally and drains to the root; losing the host of an "
                     "uncopied file means loading it from the root", step,
                     "; ".join(done.errors))
    return done
