"""The local tier across hosts: the commit record on every host, and which host holds
which file of a step.

A node-local tier directory is one host's disk: each rank writes its own data files
there, and only the coordinator's host gets ``.metadata`` and the manifest from the save.
Two things make such a tier usable after a restart:

- :func:`spread_commit` (after each local commit): the coordinator's ``.metadata`` and
  manifest go to every host that lacks them, so that each host lists the step and checks
  its own files against the manifest's CRC32Cs when it drains;
- :func:`step_holders` (before a local load): every rank says which data files of the
  step its host holds, with their sizes; the coordinator matches them against its
  manifest and answers for all: the ranks that can read each file, or "not resumable from
  the tier" when some file is on no host. The load then reads each file on a host that
  holds it, and a rank whose host lacks a file gets its bytes from a rank that has it,
  over the process group (:func:`dcpstore.dcp.read_share.plan_sharing`'s ``holders``).

Which ranks share a disk is told by the disk itself: the first rank to use a tier
directory leaves a random id in it (:func:`host_id`), and ranks that read the same id
share the disk (one host, or a shared filesystem), whatever their hostnames or rank
numbers.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from dcpstore.dcp import layout
from dcpstore.dcp.manifest import Manifest
from dcpstore.training.collectives import Collectives
from dcpstore.training.local_tier import LocalTierUnavailable, local_record

__all__ = ["HOST_MARKER", "first_ranks", "host_id", "spread_commit", "step_holders"]

logger = logging.getLogger(__name__)

#: The file in a tier directory that names its disk.
HOST_MARKER = ".dcpstore-host"

_IDS: dict[str, str] = {}


def host_id(tier: str) -> str:
    """The id of the disk holding the tier directory ``tier`` (made on first use)."""
    tier = os.path.abspath(tier)
    if tier in _IDS:
        return _IDS[tier]
    path = os.path.join(tier, HOST_MARKER)
    for _ in range(3):
        try:
            with open(path) as f:
                found = f.read().strip()
            if found:
                _IDS[tier] = found
                return found
        except FileNotFoundError:
            pass
        try:
            os.makedirs(tier, exist_ok=True)
            tmp = f"{path}.{uuid.uuid4().hex}"
            with open(tmp, "w") as f:
                f.write(uuid.uuid4().hex)
            try:
                os.link(tmp, path)  # the first rank's id wins; the others read it
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        except OSError as exc:
            raise LocalTierUnavailable(f"{tier}: cannot mark the tier's disk ({exc})") from exc
    raise LocalTierUnavailable(f"{path} stays empty; remove it and start again")


def first_ranks(hosts: list[str]) -> dict[str, int]:
    """Each host's lowest rank."""
    first: dict[str, int] = {}
    for rank, host in enumerate(hosts):
        first.setdefault(host, rank)
    return first


def _record(step_path: str) -> tuple[bytes, str, bytes]:
    """``.metadata``, the manifest's name and the manifest, as committed at ``step_path``."""
    with open(os.path.join(step_path, layout.METADATA_KEY), "rb") as f:
        raw = f.read()
    from dcpstore.dcp.safe_pickle import safe_loads

    source = f"{step_path}/{layout.METADATA_KEY}"
    name = layout.manifest_key(str(layout.save_id_of_metadata(safe_loads(raw, source=source),
                                                             source=source)))
    with open(os.path.join(step_path, name), "rb") as f:
        return raw, name, f.read()


def _write_durably(path: str, data: bytes) -> None:
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def spread_commit(step_path: str, collectives: Collectives, group: Any = None) -> int:
    """Write the step's commit record (``.metadata`` and the manifest) into every host's
    copy of the step that lacks it (manifest first, ``.metadata`` last, as a commit),
    from the lowest rank whose host has it: after a local commit (the coordinator's),
    and before a local load (a host that lost its disk). Collective over ``group``.

    Returns:
        How many hosts got it (0 on one host or a shared filesystem, or when no host has
        a record to give).
    """
    tier = os.path.dirname(os.path.abspath(step_path))
    mine = (host_id(tier), os.path.isfile(os.path.join(step_path, layout.METADATA_KEY)))
    views = collectives.all_gather(mine, group)
    lacking = {host for host, committed in views if not committed}
    givers = [rank for rank, (_, committed) in enumerate(views) if committed]
    if not lacking or not givers:
        return 0
    rank = collectives.rank(group)
    record: tuple[bytes, str, bytes] | str | None = None
    if rank == givers[0]:
        try:
            record = _record(step_path)
        except Exception as exc:
            record = f"{type(exc).__name__}: {exc}"
    record = collectives.broadcast(record, group, src=givers[0])
    if isinstance(record, str) or record is None:
        logger.warning("the commit record of %s could not be read on rank %d (%s): the "
                       "hosts lacking it load that step from the root", step_path,
                       givers[0], record)
        return 0
    host = views[rank][0]
    if host in lacking and first_ranks([h for h, _ in views])[host] == rank:
        raw, name, manifest = record
        try:
            os.makedirs(step_path, exist_ok=True)
            _write_durably(os.path.join(step_path, name), manifest)
            _write_durably(os.path.join(step_path, layout.METADATA_KEY), raw)
        except OSError as exc:  # the step is committed; this host just cannot list it
            logger.warning("could not copy the commit record of %s to this host (%s): a "
                           "restart loads that step from the root", step_path, exc)
    collectives.barrier(group)  # every host holds the record when this returns
    return len(lacking)


def _data_files(step_path: str) -> dict[str, int]:
    """This host's data files of the step (``__*``), with their sizes."""
    try:
        entries = list(os.scandir(step_path))
    except OSError:
        return {}
    return {e.name: e.stat().st_size for e in entries
            if e.name.startswith("__") and not e.name.endswith(".tmp") and e.is_file()}


def _holders(manifest: Manifest, views: list[tuple[str, dict[str, int]]], step_path: str
             ) -> dict[str, list[int]] | None:
    """Coordinator: the ranks that hold each file of ``manifest`` whole (by size), or
    ``None`` (logged) when a file is on no host. Copies of another save are ignored."""
    holders: dict[str, list[int]] = {}
    warned: set[tuple[str, str]] = set()
    for rank, (host, present) in enumerate(views):
        for name, size in present.items():
            rec = manifest.files.get(name)
            if rec is not None and rec.size == size:
                holders.setdefault(name, []).append(rank)
            elif (host, name) not in warned:
                warned.add((host, name))
                logger.warning("host %s holds %s/%s, which is not part of this step's "
                               "committed save %s (stale or damaged): ignored; its bytes "
                               "come from another copy", host, step_path, name,
                               manifest.save_id)
    missing = sorted(set(manifest.files) - set(holders))
    if missing:
        logger.info("%s is on no live host whole (%d files missing, e.g. %s): loading "
                    "from the root", step_path, len(missing), missing[0])
        return None
    return holders


def step_holders(step_path: str, collectives: Collectives, group: Any = None
                 ) -> dict[str, list[int]] | None:
    """Which ranks can read each data file of the local step ``step_path`` (collective).

    The coordinator checks its own ``.metadata`` against its manifest, and every rank
    reports its host's files; a copy of another save, or of another size, does not count.

    Returns:
        ``{}`` when every rank holds every file (one host, or a shared filesystem);
        otherwise, per file, the ranks that hold it; ``None`` when the step cannot load
        from the tier (a file on no host, or no whole record on the coordinator's host).
        The same answer on every rank.
    """
    tier = os.path.dirname(os.path.abspath(step_path))
    views = collectives.all_gather((host_id(tier), _data_files(step_path)), group)

    def decide() -> dict[str, list[int]] | None:
        manifest = local_record(step_path)
        if manifest is None:
            return None
        holders = _holders(manifest, views, step_path)
        if holders is not None and all(len(r) == len(views) for r in holders.values()):
            return {}
        return holders

    return collectives.share(decide if collectives.is_coordinator(group) else None,
                             f"checking the local tier's {step_path} on the coordinator "
                             "failed", group)
