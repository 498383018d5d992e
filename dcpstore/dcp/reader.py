"""The DCP protocol: :class:`Reader`, DCP's ``StorageReader`` over any backend.

The reader itself only follows DCP's calls; the work is done by one module per job:

- :mod:`dcpstore.dcp.metadata_io`: load ``.metadata`` and the integrity manifest safely;
- :mod:`dcpstore.dcp.read_plan`: which bytes each read item needs, coalesced into ranges;
- :mod:`dcpstore.dcp.delivery`: lay out each range's buffers, fetch, verify, deliver;
- :mod:`dcpstore.dcp.read_share`: read once, share: bytes several ranks need are fetched by
  one and sent to the others, and only the coordinator reads ``.metadata``.

Only the coordinator of a ``dcp.load`` holds the whole integrity manifest: it sends each
rank the records of the items that rank reads in its load plan (:class:`RankReads`), so
what a rank holds grows with its own share of the checkpoint, not with the world size.

The load's process group comes from the caller (``get_reader(process_group=...)``;
:func:`dcpstore.load` passes its own) or, when none was given, from DCP's calls: the
coordinator learns from the plans it is handed how many ranks load, and which rank
coordinates comes with ``set_up_storage_reader``. Without a group given, every rank reads
``.metadata`` itself (as torch's own readers do); the data reads are still shared when
the load runs over the whole world.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcpstore.dcp import layout, metadata_io, read_share
from dcpstore.dcp.bound import BoundToBackend
from dcpstore.dcp.checksum import crc32c
from dcpstore.dcp.delivery import Delivery, fetch_and_deliver
from dcpstore.dcp.dist import UNSET
from dcpstore.dcp.manifest import SAVE_ID_PREFIX, Manifest
from dcpstore.dcp.read_plan import ChunkIndex, ItemRead, chunk_index, coalesce, plan_reads
from dcpstore.dcp.references import root_key, run_root
from dcpstore.errors import CheckpointNotFoundError, DcpstoreError, IntegrityError
from dcpstore.storage.backend import Backend
from dcpstore.storage.local import LocalBackend
from dcpstore.storage.options import ReaderOptions
from dcpstore.torch_internals import StorageInfo, StorageReaderTransforms

__all__ = ["RankReads", "Reader", "ReaderOptions"]

logger = logging.getLogger(__name__)


@dataclass
class RankReads:
    """What the coordinator of a load sends one rank in ``LoadPlan.storage_data``.

    Attributes:
        manifest: The integrity manifest cut to the items of this rank's plan
            (:meth:`~dcpstore.dcp.manifest.Manifest.subset`); ``None``: the checkpoint has no
            manifest, or the load does not verify.
        share: This rank's part of the read-once schedule (``None``: no sharing).
        world_coordinator: With sharing over the world that the reader found by itself
            (no group was given): the coordinator's rank, so that every rank joins the
            same transport group; ``None`` otherwise.
    """

    manifest: Manifest | None
    share: read_share.RankShare | None = None
    world_coordinator: int | None = None


_warned = threading.Event()


def _warn_group_unknown(ranks: int) -> None:
    if not _warned.is_set():
        _warned.set()
        logger.warning(
            "dcp.load ran on %d ranks with a dcpstore reader that was given no "
            "process_group: every rank read .metadata itself, and bytes several ranks need "
            "are shared only when the load runs over the whole world. Pass the load's group "
            "to get_reader(process_group=...) (dcpstore.load does) to read them once.", ranks)


class Reader(BoundToBackend, StorageReader):
    """DCP storage reader over a :class:`~dcpstore.Backend`. Create with
    :func:`dcpstore.get_reader`; pass as ``storage_reader=`` to ``dcp.load``.

    DCP calls, in this order (``dcp.load``)::

        validate_checkpoint_id(id)        classmethod: can this reader load ``id``?
        reset(checkpoint_id)              every rank; a new load
        read_metadata()                   every rank: restricted unpickle of .metadata,
                                          stored paths validated, manifest fetched
                                          (sharing: by the coordinator, broadcast)
        set_up_storage_reader(md, ...)    every rank
        prepare_local_plan(plan)          every rank (pass-through)
        prepare_global_plan(plans)        coordinator: with sharing, give each byte
                                          range several ranks need to one of them
        read_data(plan, planner)          every rank: shared ranges fetched by their
                                          owners and exchanged; then group the rest by
                                          file, sort by offset, coalesce neighbours,
                                          fetch ranges concurrently; verify CRC32C,
                                          copy into the destination tensors

    Only the byte ranges of the items in this rank's plan are fetched, and on a reshard
    (N -> M) a rank that needs part of a saved chunk fetches only the payload blocks
    around that part, verified against the manifest's per-block CRC32Cs
    (``Payload.block_crcs``), instead of the whole item: a reshard reads about what the
    rank needs, not whole items or files. Payloads are read straight into the
    destination tensors where their layout allows (a scatter read), so most bytes are
    never copied after they arrive. Bytes several ranks need are fetched once and
    shared over the process group (``broadcast_reads``, :mod:`dcpstore.dcp.read_share`).

    Args:
        backend: Where the checkpoint is.
        options: Reader options.
        extension_registry: Decoders for DCP stream transforms (defaults to torch's).
        rebind: Function turning a ``checkpoint_id`` passed to ``dcp.load`` into a
            backend with the same options (set by :func:`dcpstore.get_reader`).
        process_group: The process group of the ``dcp.load`` this reader serves
            (``None``: the world). Not given: learnt from DCP's calls (see the module).
        file_holders: For a checkpoint spread over several hosts' disks (a node-local
            tier): for each data file, the ranks of ``process_group`` that can read it
            through ``backend``. A rank's reads of a file it cannot read are fetched by
            a rank that can and sent to it over the group (read sharing, always on
            here). ``None``: every rank reads every file.
    """

    _bound_as = "this Reader loads from"

    def __init__(self, backend: Backend, options: ReaderOptions | None = None, *,
                 extension_registry: Any = None, rebind: Any = None,
                 process_group: Any = UNSET,
                 file_holders: Mapping[str, Collection[int]] | None = None) -> None:
        super().__init__(backend, rebind)
        if file_holders is not None and process_group is UNSET:
            raise ValueError("file_holders needs the load's process_group")
        self.process_group = process_group
        self.file_holders = file_holders
        self.options = options or ReaderOptions()
        self._transforms = StorageReaderTransforms(extension_registry)
        self.storage_data: dict[MetadataIndex, StorageInfo] = {}
        self._chunks: ChunkIndex = {}
        self._metadata: Metadata | None = None
        #: The integrity manifest: the whole one on the coordinator (and when reading
        #: alone), on another rank of a ``dcp.load`` the records of its own reads, set
        #: by ``read_data`` from its plan.
        self.manifest: Manifest | None = None
        # another rank of a dcp.load: its manifest comes in its load plan
        self._manifest_deferred = False
        # what the coordinator broadcast: save id, .metadata record, references
        self._manifest_header: Manifest | None = None
        # size and CRC32C of the .metadata this rank read, checked against its manifest
        self._metadata_digest: tuple[int, int] | None = None
        self.load_id = uuid.uuid4().hex
        #: Bytes fetched by the last ``read_data`` (coalescing gaps included).
        self.bytes_read = 0
        #: Bytes the last ``read_data`` needed (sum of its items).
        self.bytes_needed = 0
        #: Range requests issued by the last ``read_data``.
        self.requests = 0
        #: Tensor items of the last ``read_data`` whose bytes were read straight into the
        #: destination tensor (no staging buffer, no copy).
        self.items_direct = 0
        #: Tensor items of the last ``read_data`` that needed only part of a saved chunk
        #: (a reshard) and were served by fetching just the payload blocks around it.
        self.items_partial = 0
        #: Bytes of the last ``read_data`` received from other ranks (read once, share).
        self.bytes_received = 0
        #: Bytes of the last ``read_data`` this rank fetched and sent to other ranks.
        self.bytes_sent = 0
        #: Why the last ``read_metadata`` failed (DCP wraps it in an AssertionError).
        self.metadata_error: BaseException | None = None
        #: The ranks this load shares reads with (``None``: it reads alone).
        self._share: read_share.ShareContext | None = None
        # run root and this checkpoint's name in it, when it references sibling steps
        self._run_root: tuple[Backend, str] | None = None

    def __repr__(self) -> str:
        return f"Reader({self.backend.uri!r})"

    # -- DCP protocol ------------------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        """Start a new load, optionally from another location (same backend options)."""
        self._move_to(checkpoint_id)
        self.storage_data = {}
        self.manifest = None
        self._manifest_deferred = False
        self._manifest_header = None
        self._metadata_digest = None
        self._metadata = None
        self._chunks = {}
        self.metadata_error = None
        self._share = None
        self.load_id = uuid.uuid4().hex
        if self._run_root is not None:
            self._run_root[0].close()
            self._run_root = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read and validate ``.metadata`` (and the manifest it names)."""
        try:
            if kwargs.get("rank") is None:
                self._share = self._share_context()
            return self._read_metadata(*args, **kwargs)
        except BaseException as exc:
            if kwargs.get("rank") is None:
                self.metadata_error = exc
                # some torch releases (2.10) swallow this error and fail the load with
                # only "metadata is None": the log is where a plain dcp.load says why
                logger.error("cannot load %s: %s: %s", self.backend.uri,
                             type(exc).__name__, exc)
            raise

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Index the storage entries and saved chunks of ``metadata``."""
        if metadata.storage_data is None:
            raise IntegrityError(f"{self.backend.uri}/.metadata has no storage_data")
        self.storage_data = metadata.storage_data
        self._metadata = metadata
        if not kwargs.get("use_collectives", True):
            self._share = None
        if is_coordinator and self._manifest_deferred and self.manifest is None:
            # DCP's coordinator plans every rank's reads: it holds the whole manifest
            self._manifest_deferred = False
            self.manifest = self._read_manifest(metadata)
            if self.manifest is not None and self._metadata_digest is not None:
                self.manifest.check_metadata_digest(
                    *self._metadata_digest, source=f"{self.backend.uri}/.metadata")
        elif self.manifest is None and self.options.verify and not self._manifest_deferred:
            # read_metadata ran on another object (e.g. metadata passed in directly)
            self.manifest = self._read_manifest(metadata)
        self._bind_references(metadata)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Pass-through."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Give each rank the manifest records of its reads and, with sharing, give each
        byte range several ranks need to one of them (read once, share)."""
        shares: list[read_share.RankShare | None] = [None] * len(plans)
        world_coordinator = self._find_world_share(len(plans))
        if self._share is not None or world_coordinator is not None:
            chunks = self._chunk_index(p.items for p in plans)
            requests = [plan_reads(p.items, self.storage_data, self.manifest, chunks,
                                   uri=self.backend.uri) for p in plans]
            del chunks
            shares = list(read_share.plan_sharing(requests, holders=self.file_holders))
            del requests
            first = shares[0]
            if first is not None and first.shared_bytes:
                logger.info("%s: %d bytes needed by several ranks are fetched once and "
                            "shared", self.backend.uri, first.shared_bytes)
        manifest = self.manifest
        out = []
        for plan, share in zip(plans, shares, strict=True):
            mine = None
            if manifest is not None:
                infos = (self.storage_data.get(i.storage_index) for i in plan.items)
                mine = manifest.subset((info.relative_path, info.offset)
                                       for info in infos if info is not None)
            out.append(dataclasses.replace(
                plan, storage_data=RankReads(mine, share, world_coordinator)))
        return out

    def _find_world_share(self, ranks: int) -> int | None:
        """The coordinator, given ``ranks`` plans, when no group was given: this rank's
        global rank if the load runs over the whole world and its reads are shared (the
        other ranks join the world's transport group in ``read_data``), else ``None``."""
        if self.process_group is not UNSET or ranks < 2:
            return None
        _warn_group_unknown(ranks)
        if (not self._sharing_wanted() or not dist.is_initialized()
                or ranks != dist.get_world_size()):
            return None
        return dist.get_rank()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fetch, verify and deliver the items of this rank's ``plan``."""
        reads = plan.storage_data if isinstance(plan.storage_data, RankReads) else None
        if reads is not None and reads.world_coordinator is not None and self._share is None:
            # every rank of the world gets here: the transport group is made collectively
            self._share = read_share.share_context(None, reads.world_coordinator)
        share = reads.share if reads is not None and self._share is not None else None
        if self._share is not None and share is None:
            raise DcpstoreError(
                "the load plan carries no dcpstore read schedule (the planner's finish_plan "
                "dropped LoadPlan.storage_data); load with broadcast_reads=False"
            )
        manifest = self._plan_manifest(reads)
        self._chunks = self._chunk_index([plan.items])
        requests = plan_reads(plan.items, self.storage_data, manifest, self._chunks,
                              uri=self.backend.uri)
        shared: dict[read_share.UnitKey, list[ItemRead]] = {}
        if share is not None:
            keys = {u.key for window in share.windows for u in window}
            for request in requests:
                if read_share.unit_key(request) in keys:
                    shared.setdefault(read_share.unit_key(request), []).append(request)
        private = [r for r in requests if read_share.unit_key(r) not in shared]
        ranges = coalesce(private, self.options.coalesce_gap, self.options.max_range)
        self.bytes_needed = sum(r.needed for r in requests)
        self.bytes_read = sum(r.length for r in ranges)
        self.requests = len(ranges)
        self.bytes_received = self.bytes_sent = 0
        self.items_partial = sum(r.partial is not None for r in requests)
        self.items_direct = 0
        source, to_key = self.backend, None
        if self._run_root is not None:  # an incremental checkpoint: read via the run root
            source, name = self._run_root
            to_key = functools.partial(root_key, name)
            ranges = [dataclasses.replace(r, key=to_key(r.key)) for r in ranges]
        delivery = Delivery(self.backend.uri, planner, manifest, self._chunks,
                            self._transforms, allow_pickle=self.options.allow_pickle)
        try:
            if share is not None and self._share is not None:
                # shared first: the other ranks wait for what this one fetches for them
                stats = read_share.exchange(self._share, share, source, shared, delivery,
                                            gap=self.options.coalesce_gap,
                                            max_range=self.options.max_range, key_of=to_key)
                self.bytes_read += stats.bytes_fetched
                self.requests += stats.requests
                self.bytes_received, self.bytes_sent = stats.bytes_received, stats.bytes_sent
            fetch_and_deliver(source, ranges, delivery)
        finally:
            self.items_direct = delivery.items_direct
            if source is not self.backend:
                source.close()  # its threads and client; made again if used again
        logger.debug("%s: %d items (%d partial, %d shared) in %d requests, %d bytes fetched "
                     "(%d needed), %d received from and %d sent to other ranks",
                     self.backend.uri, len(requests), self.items_partial,
                     sum(map(len, shared.values())), self.requests, self.bytes_read,
                     self.bytes_needed, self.bytes_received, self.bytes_sent)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- internals ---------------------------------------------------------------------

    def _read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointNotFoundError(
                f"{self.backend.uri}: rank-local metadata (use_collectives=False) is not "
                "a dcpstore checkpoint format"
            )
        self._manifest_header = self._metadata_digest = None
        # a rank other than DCP's coordinator gets the manifest records of its reads in
        # its plan; which rank coordinates is known here with a group, else only in
        # set_up_storage_reader (the coordinator reads the manifest there)
        share = self._share
        self._manifest_deferred = self.options.verify and not self._coordinates(share)
        if share is not None:
            metadata, raw, self.manifest = self._shared_metadata(share)
        else:
            metadata, raw = metadata_io.load_metadata(self.backend,
                                                      trusted=self.options.allow_unsafe_metadata,
                                                      diagnose_missing=True)
            self.manifest = None if self._manifest_deferred else self._read_manifest(metadata)
        source = f"{self.backend.uri}/.metadata"
        for manifest in (self.manifest, self._manifest_header):
            if manifest is not None:
                manifest.check_metadata(raw, source=source)
        if self._manifest_deferred:
            self._metadata_digest = (len(raw), crc32c(raw))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _coordinates(self, share: read_share.ShareContext | None) -> bool:
        """Whether this rank is known, before ``set_up_storage_reader``, to coordinate
        the load (or to read alone): without a process group, or with a group given
        (its rank 0, DCP's default coordinator). ``False`` when it cannot know yet."""
        if share is not None:
            return share.rank == share.coordinator
        if not (dist.is_available() and dist.is_initialized()):
            return True
        if self.process_group is UNSET:
            return False
        return dist.get_rank(self.process_group) == 0

    def _sharing_wanted(self) -> bool:
        """Whether reads are shared, per ``broadcast_reads`` (default: off for local
        files, which every rank reads at page-cache speed)."""
        if self.file_holders is not None:
            return True  # files a rank cannot read reach it only through the group
        wanted = self.options.broadcast_reads
        return not (wanted is False
                    or (wanted is None and isinstance(self.backend, LocalBackend)))

    def _share_context(self) -> read_share.ShareContext | None:
        """The ranks this load shares reads with, when its group is known."""
        if self.process_group is UNSET or not self._sharing_wanted():
            return None
        return read_share.share_context(self.process_group)

    def _shared_metadata(self, share: read_share.ShareContext
                         ) -> tuple[Metadata, bytes, Manifest | None]:
        """``.metadata`` and the manifest, read by the coordinator alone and broadcast."""
        mine: list[Any] = []  # the coordinator's parsed copies

        def read() -> list[bytes | None]:
            metadata, raw = metadata_io.load_metadata(self.backend,
                                                      trusted=self.options.allow_unsafe_metadata,
                                                      diagnose_missing=True)
            manifest = self._read_manifest(metadata)
            mine.extend((metadata, raw, manifest))
            # the other ranks get the item records of their reads in their load plans
            return [raw, None if manifest is None else manifest.header().to_bytes()]

        raw, raw_manifest = read_share.broadcast_blobs(share, read, 2)
        if mine:
            self._manifest_deferred = False
            return mine[0], mine[1], mine[2]
        assert raw is not None
        source = f"{self.backend.uri}/{layout.METADATA_KEY}"
        metadata = metadata_io.parse_metadata(raw, source=source,
                                              trusted=self.options.allow_unsafe_metadata)
        manifest = None
        if raw_manifest is not None:
            save_id = str(layout.save_id_of_metadata(metadata, source=source))
            manifest = Manifest.from_bytes(
                raw_manifest, source=f"{self.backend.uri}/{layout.manifest_key(save_id)}")
            if manifest.save_id != save_id:
                raise IntegrityError(f"{self.backend.uri}: the manifest belongs to save "
                                     f"{manifest.save_id}, not {save_id}")
        if self._manifest_deferred:
            self._manifest_header = manifest
            return metadata, raw, None
        return metadata, raw, manifest

    def _bind_references(self, metadata: Metadata) -> None:
        """Admit references into sibling steps (recorded in the manifest) and open the
        run root they are read through."""
        if self._run_root is not None or not metadata_io.references_in(metadata):
            return
        manifest = self.manifest or self._manifest_header
        if manifest is None:  # verify=False: still only the references the save made
            save_id = layout.save_id_of_metadata(metadata,
                                                 source=f"{self.backend.uri}/.metadata")
            manifest = metadata_io.read_manifest(
                self.backend, save_id, required=True,
                hint=" (its references cannot be checked without it)")
        metadata_io.check_references(metadata, manifest, source=f"{self.backend.uri}/.metadata")
        self._run_root = run_root(self.backend)

    def _chunk_index(self, plans: Any) -> ChunkIndex:
        """The saved chunks the read items of ``plans`` (iterables of items) read."""
        if self._metadata is None:
            raise DcpstoreError("read_data before set_up_storage_reader: no .metadata")
        return chunk_index(self._metadata, (item.storage_index for items in plans
                                            for item in items))

    def _plan_manifest(self, reads: RankReads | None) -> Manifest | None:
        """The manifest this rank verifies its reads against: its own (the coordinator,
        or reading alone), else the records the coordinator put in its plan."""
        if not self._manifest_deferred:
            return self.manifest
        source = f"{self.backend.uri}/.metadata"
        if reads is None:
            # a planner dropped the plan's storage_data: read the whole manifest here
            assert self._metadata is not None
            self.manifest = self._read_manifest(self._metadata)
        else:
            self.manifest = reads.manifest
            save_id = getattr(self._metadata.storage_meta if self._metadata else None,
                              "save_id", None)
            if (self.manifest is None and isinstance(save_id, str)
                    and save_id.startswith(SAVE_ID_PREFIX)):
                raise IntegrityError(
                    f"{self.backend.uri}: the load plan carries no integrity manifest for "
                    f"save {save_id}, which has one; the coordinator loaded without "
                    "verify: load with the same options on every rank"
                )
        self._manifest_deferred = False
        if self.manifest is not None and self._metadata_digest is not None:
            self.manifest.check_metadata_digest(*self._metadata_digest, source=source)
        return self.manifest

    def _read_manifest(self, metadata: Metadata) -> Manifest | None:
        if not self.options.verify:
            return None
        source = f"{self.backend.uri}/.metadata"
        save_id = layout.save_id_of_metadata(metadata, source=source)
        manifest = metadata_io.read_manifest(self.backend, save_id, required=True,
                                             hint=" (pass verify=False to load it unverified)")
        if manifest is not None:
            metadata_io.check_one_save(metadata, manifest, source)
        return manifest
