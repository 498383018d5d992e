"""The systems the benchmark compares: one small adapter each.

Every adapter turns a save or a load of the rank's state into an :class:`Operation`
whose :meth:`~Operation.run` is the only thing timed. Building writers, readers,
clients, thread pools and (for the raw limits) the byte buffers happens before, untimed;
the lazy set-up a library does on first use (connections, native clients) is timed, as
a trainer would pay it.

DCP systems (``dcp.save`` / ``dcp.load`` with the system's ``StorageWriter`` /
``StorageReader``, library defaults unless ``--opt`` says otherwise):

=====================  ==================================================================
``dcpstore-local``     dcpstore, local backend (``fsync`` of data files and directory)
``torch-fs``           torch ``FileSystemWriter(sync_files=True)`` / ``FileSystemReader``
``dcpstore-s3``        dcpstore, S3 backend (botocore)
``torch-fsspec-s3``    torch ``FsspecWriter`` / ``FsspecReader`` over s3fs
``s3torchconnector``   ``S3StorageWriter`` / ``S3StorageReader`` (its default DCP reader)
``msc``                multi-storage-client's ``MultiStorageFileSystemWriter`` / ``Reader``
``dcpstore-msc``       dcpstore, MSC backend (same MSC profile)
``dcpstore-gcs``       dcpstore, GCS backend (gcsfs session, JSON API)
``torch-fsspec-gcs``   torch ``FsspecWriter`` / ``FsspecReader`` over gcsfs
=====================  ==================================================================

Limits (the same bytes, no DCP, no serialization, no checksums): ``limit-local``,
``limit-s3``, ``limit-gcs``, in :mod:`benchmarks.limits` (registered here). The bracket
is the variant (e.g. ``limit-s3[crt-32MiBx8]``); the benchmark runs several and calls
the fastest "the limit".

**Equal request settings.** Every botocore-based client (dcpstore-s3, dcpstore-msc,
``torch-fsspec-s3`` through s3fs/aiobotocore, ``msc``, ``limit-s3``) is configured the
same way: ``payload_signing_enabled=False`` (``UNSIGNED-PAYLOAD``, which botocore's S3
signer obeys over plain HTTP too when it is set explicitly) and
``request_checksum_calculation`` / ``response_checksum_validation`` =
``"when_required"`` (no per-request CRC trailers, no response checksum validation).
s3torchconnector's CRT client exposes neither setting (see :mod:`benchmarks.wire`).
:meth:`System.settings` states them per system; the report prints them.

**TLS** (``--tls``). Every server is reached over HTTPS with a certificate of a throwaway
CA, which each client trusts the way its stack reads a CA from the environment
(:meth:`System.tls_trust`, stated per system in the report): ``AWS_CA_BUNDLE`` for the
botocore-based ones, ``SSL_CERT_FILE`` for aiohttp (GCS) and the CRT clients. The
environment is the same for every system of a store (:func:`environment`).

**Peers at their best.** A peer's ``grid`` lists the options tried in the tuning phase
(``benchmarks.tuning``): threads (and part sizes) crossed, then one at a time
(:class:`Grid`) the fsspec filesystems' ``block_size``, s3torchconnector's
``reader_constructor`` and ``throughput_target_gbps``. A peer label's bracket is either
``best`` (the options the tuning picked, per operation) or explicit options,
``msc[thread_count=4,part_size=8MiB]``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, ClassVar

from . import stall_systems
from .adapters import (
    Grid,
    OpContext,
    Operation,
    System,
    environment,
    options_variant,
    parse_option_value,
    parse_options_variant,
    split_variant,
)
from .limits import LimitGCS, LimitLocal, LimitS3, LimitSystem
from .wire import BOTOCORE_S3_CONFIG, CRT_SETTINGS, msc_part_profile
from .workload import RankState

__all__ = [
    "DEFAULT_SYSTEMS",
    "GRID_GCSFS_BLOCK_SIZES",
    "GRID_PART_SIZES",
    "GRID_S3FS_BLOCK_SIZES",
    "GRID_S3FS_CACHE_TYPES",
    "GRID_S3TC_READERS",
    "GRID_S3TC_THROUGHPUT",
    "GRID_THREADS",
    "STALL_PREFIX",
    "Grid",
    "OpContext",
    "Operation",
    "System",
    "environment",
    "get",
    "names",
    "options_variant",
    "parse_option_value",
    "parse_options_variant",
    "split_variant",
]

logger = logging.getLogger(__name__)

_MiB = 1 << 20

#: The tuning grid's values (``--grid`` overrides them): threads / concurrency and part size.
GRID_THREADS: tuple[int, ...] = (1, 4, 8)
GRID_PART_SIZES: tuple[int, ...] = (8 * _MiB, 32 * _MiB)
#: Values tried one at a time (:class:`Grid`; the library's default first): the fsspec
#: filesystems' block size (s3fs: 50 MiB, gcsfs: 5 MiB), the part size of their uploads
#: (a file smaller than a block is one PUT) and what each read fetches beyond the bytes
#: asked for (fsspec's ``readahead`` cache, their default).
GRID_S3FS_BLOCK_SIZES: tuple[int, ...] = (50 * _MiB, 16 * _MiB, 128 * _MiB)
GRID_GCSFS_BLOCK_SIZES: tuple[int, ...] = (5 * _MiB, 16 * _MiB, 64 * _MiB)
#: s3fs's cache types: its default, and ``None`` (fsspec's ``"none"``: every read one GET
#: of exactly its range; a label writes ``cache_type=None``, as ``none`` parses to
#: ``None``). The grid lists the default only, so it adds no point: on moto, whose ranged
#: GETs copy the whole object, a load without the cache took 46 s against 1.4-2.0
#: (64 MiB, 1 rank). ``--grid cache_type=readahead,none`` (crossed) or ``--opt
#: torch-fsspec-s3.cache_type=none`` tries it.
GRID_S3FS_CACHE_TYPES: tuple[str | None, ...] = ("readahead", None)
#: s3torchconnector's DCP reader (``S3ReaderConstructor``; 1.5's default first) and its
#: CRT client's throughput target (Gbit/s, ``S3ClientConfig``; it sizes the connection
#: pool), one at a time.
GRID_S3TC_READERS: tuple[str, ...] = ("dcp_optimized", "sequential", "range_based")
GRID_S3TC_THROUGHPUT: tuple[int, ...] = (10, 25, 100)

# -- DCP systems ---------------------------------------------------------------------------


class DCPSystem(System):
    """``dcp.save`` / ``dcp.load`` through a ``StorageWriter`` / ``StorageReader``."""

    def writer(self, ctx: OpContext) -> Any:
        """The storage writer for ``ctx``."""
        raise NotImplementedError

    def reader(self, ctx: OpContext) -> Any:
        """The storage reader for ``ctx``."""
        raise NotImplementedError

    def save_figures(self, writer: Any) -> dict[str, Any]:
        """Figures to report after a save."""
        return {}

    def load_figures(self, reader: Any) -> dict[str, Any]:
        """Figures to report after a load."""
        return {}

    def prepare_save(self, ctx: OpContext, state: RankState) -> Operation:
        import torch.distributed.checkpoint as dcp

        sd = state.source()
        writer = self.writer(ctx)

        def run() -> dict[str, Any]:
            dcp.save(sd, storage_writer=writer)
            return self.save_figures(writer)

        return Operation(run, close=lambda: _close_backend(writer))

    def prepare_load(self, ctx: OpContext, state: RankState) -> Operation:
        import torch.distributed.checkpoint as dcp

        sd = state.destination()
        reader = self.reader(ctx)

        def run() -> dict[str, Any]:
            dcp.load(sd, storage_reader=reader)
            return self.load_figures(reader)

        return Operation(run, close=lambda: _close_backend(reader))


def _close_backend(obj: Any) -> None:
    backend = getattr(obj, "backend", None)
    if backend is not None and hasattr(backend, "close"):
        backend.close()


class Dcpstore(DCPSystem):
    """dcpstore through one of its backends."""

    is_dcpstore = True
    scheme: ClassVar[str] = ""

    def uri(self, ctx: OpContext) -> str:
        """The checkpoint URI."""
        raise NotImplementedError

    def base_options(self, ctx: OpContext) -> dict[str, Any]:
        """Options that point the backend at the store (endpoint, config)."""
        return {}

    def variant_options(self) -> dict[str, Any]:
        """A bracket's options (an A/B variant of the defaults): dcpstore options only."""
        import dcpstore
        from dcpstore.storage.options import option_names

        opts = super().variant_options()
        known = (self._backend_option_names() | option_names(dcpstore.WriterOptions)
                 | option_names(dcpstore.ReaderOptions))
        unknown = sorted(set(opts) - known)
        if unknown:
            raise ValueError(f"{self.label}: not a dcpstore option: {', '.join(unknown)}")
        return opts

    def _backend_option_names(self) -> set[str]:
        from dcpstore.storage.options import option_names
        from dcpstore.storage.registry import backend_class

        return option_names(backend_class(self.scheme).Options)

    def _options(self, ctx: OpContext, own: type[Any]) -> dict[str, Any]:
        from dcpstore.storage.options import option_names

        allowed = option_names(own) | self._backend_option_names()
        opts = self.base_options(ctx)
        opts.update({k: v for k, v in ctx.options.items() if k in allowed})
        return opts

    def writer(self, ctx: OpContext) -> Any:
        import dcpstore

        return dcpstore.get_writer(self.uri(ctx), **self._options(ctx, dcpstore.WriterOptions))

    def reader(self, ctx: OpContext) -> Any:
        import torch.distributed as dist

        import dcpstore

        # the load's group, as dcpstore.load passes it: .metadata is read once and bytes
        # several ranks need (a reshard) are read once and shared
        group = {"process_group": None} if dist.is_initialized() else {}
        return dcpstore.get_reader(self.uri(ctx), **group,
                                   **self._options(ctx, dcpstore.ReaderOptions))

    @staticmethod
    def _backend_figures(obj: Any) -> dict[str, Any]:
        o = obj.backend.options
        figures: dict[str, Any] = {"part_size": int(o.part_size),
                                   "max_concurrency": int(o.max_concurrency)}
        files = getattr(getattr(obj, "options", None), "files_per_rank", None)
        if files is not None:
            figures["files_per_rank"] = int(files)
        # a plugin's own request counters (S3's), on its store
        counts = getattr(getattr(obj.backend, "store", None), "request_counts", None)
        if counts:
            figures["backend_requests"] = dict(counts)
        # what the adaptive concurrency limits settled on (dcpstore.storage.concurrency)
        limits = obj.backend.concurrency_figures()
        if limits:
            figures["concurrency"] = limits
        return figures

    def save_figures(self, writer: Any) -> dict[str, Any]:
        return self._backend_figures(writer)

    def load_figures(self, reader: Any) -> dict[str, Any]:
        figures = self._backend_figures(reader)
        figures.update(bytes_read=int(reader.bytes_read), bytes_needed=int(reader.bytes_needed),
                       range_requests=int(reader.requests))
        return figures


class DcpstoreLocal(Dcpstore):
    name = "dcpstore-local"
    scheme = "file"
    kinds = ("local",)
    requires = ("dcpstore",)
    description = "dcpstore, local backend (fsync on)"

    def uri(self, ctx: OpContext) -> str:
        return os.path.join(ctx.store.root, ctx.path)


class DcpstoreS3(Dcpstore):
    name = "dcpstore-s3"
    scheme = "s3"
    kinds = ("s3",)
    requires = ("dcpstore_s3", "botocore")
    description = "dcpstore, S3 backend (botocore)"
    client_stack = "botocore"

    def uri(self, ctx: OpContext) -> str:
        return f"s3://{ctx.store.root}/{ctx.path}"

    def base_options(self, ctx: OpContext) -> dict[str, Any]:
        return {"endpoint_url": ctx.store.endpoint_url, "region": ctx.store.region}


class DcpstoreMSC(Dcpstore):
    name = "dcpstore-msc"
    scheme = "msc"
    kinds = ("s3",)
    requires = ("dcpstore_msc", "multistorageclient")
    description = "dcpstore, MSC backend (same MSC profile as msc)"
    client_stack = "msc"

    def uri(self, ctx: OpContext) -> str:
        return f"msc://{ctx.store.msc_profile}/{ctx.path}"

    def base_options(self, ctx: OpContext) -> dict[str, Any]:
        return {"config": ctx.store.msc_config}


class DcpstoreGCS(Dcpstore):
    name = "dcpstore-gcs"
    scheme = "gs"
    kinds = ("gcs",)
    requires = ("dcpstore_gcs", "gcsfs")
    description = "dcpstore, GCS backend"
    client_stack = "aiohttp"

    def uri(self, ctx: OpContext) -> str:
        return f"gs://{ctx.store.root}/{ctx.path}"

    def base_options(self, ctx: OpContext) -> dict[str, Any]:
        return {"endpoint_url": ctx.store.endpoint_url, "token": "anon"}


class TorchFS(DCPSystem):
    name = "torch-fs"
    kinds = ("local",)
    description = "torch FileSystemWriter(sync_files=True) / FileSystemReader"
    grid = {"thread_count": GRID_THREADS}
    defaults = {"thread_count": 1}

    def writer(self, ctx: OpContext) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter

        opts = {"sync_files": True, **ctx.options}
        return FileSystemWriter(os.path.join(ctx.store.root, ctx.path), **opts)

    def reader(self, ctx: OpContext) -> Any:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(os.path.join(ctx.store.root, ctx.path))


class TorchFsspec(DCPSystem):
    """torch's fsspec writer/reader (``sync_files=False``: object stores have no fsync,
    and torch would fall back to a machine-wide ``os.sync()``).

    Options: those of :attr:`fs_options` are the filesystem's (torch passes the writer's
    and the reader's extra keyword arguments to ``fsspec.url_to_fs``, which builds the
    filesystem with them: both get them); the rest (``thread_count``, ...) go to
    ``FsspecWriter``, and the reader has none.
    """

    protocol: ClassVar[str] = ""
    #: Option -> the filesystem's keyword argument (torch opens every file with the
    #: filesystem's defaults, so they are set on the filesystem).
    fs_options: ClassVar[dict[str, str]] = {}
    reader_keys = frozenset({"block_size"})

    def storage_options(self, ctx: OpContext) -> dict[str, Any]:
        """fsspec filesystem keyword arguments: the store's, then :attr:`fs_options`."""
        opts = self.store_options(ctx)
        for key, kw in self.fs_options.items():
            if key in ctx.options:
                value = ctx.options[key]
                if key == "block_size":
                    value = int(value)
                elif key == "cache_type" and value is None:
                    value = "none"  # "none" parses to None (parse_option_value)
                opts[kw] = value
        return opts

    def store_options(self, ctx: OpContext) -> dict[str, Any]:
        """fsspec filesystem keyword arguments that point it at the store."""
        raise NotImplementedError

    def _uri(self, ctx: OpContext) -> str:
        return f"{self.protocol}://{ctx.store.root}/{ctx.path}"

    def writer(self, ctx: OpContext) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        rest = {k: v for k, v in ctx.options.items() if k not in self.fs_options}
        opts = {"sync_files": False, **self.storage_options(ctx), **rest}
        return FsspecWriter(self._uri(ctx), **opts)

    def reader(self, ctx: OpContext) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(self._uri(ctx), **self.storage_options(ctx))


class TorchFsspecS3(TorchFsspec):
    name = "torch-fsspec-s3"
    kinds = ("s3",)
    requires = ("s3fs",)
    protocol = "s3"
    description = "torch FsspecWriter / FsspecReader over s3fs"
    client_stack = "aiobotocore"

    grid = Grid({"thread_count": GRID_THREADS},
                single={"block_size": GRID_S3FS_BLOCK_SIZES,
                        "cache_type": GRID_S3FS_CACHE_TYPES[:1]})
    reader_keys = frozenset({"block_size", "cache_type"})
    defaults = {"thread_count": 1, "block_size": GRID_S3FS_BLOCK_SIZES[0],
                "cache_type": GRID_S3FS_CACHE_TYPES[0]}
    fs_options = {"block_size": "default_block_size", "cache_type": "default_cache_type"}

    def store_options(self, ctx: OpContext) -> dict[str, Any]:
        # config_kwargs: aiobotocore's AioConfig, the same settings as every botocore client
        return {"endpoint_url": ctx.store.endpoint_url,
                "client_kwargs": {"region_name": ctx.store.region},
                "config_kwargs": {k: (dict(v) if isinstance(v, dict) else v)
                                  for k, v in BOTOCORE_S3_CONFIG.items()}}


class TorchFsspecGCS(TorchFsspec):
    name = "torch-fsspec-gcs"
    kinds = ("gcs",)
    requires = ("gcsfs",)
    protocol = "gs"
    description = "torch FsspecWriter / FsspecReader over gcsfs"
    client_stack = "aiohttp"
    # gcsfs takes no default cache type: torch opens every file with the "readahead"
    # cache of fsspec's buffered files
    grid = Grid({"thread_count": GRID_THREADS}, single={"block_size": GRID_GCSFS_BLOCK_SIZES})
    defaults = {"thread_count": 1, "block_size": GRID_GCSFS_BLOCK_SIZES[0]}
    fs_options = {"block_size": "block_size"}

    def store_options(self, ctx: OpContext) -> dict[str, Any]:
        return {"endpoint_url": ctx.store.endpoint_url, "token": "anon"}


class S3TorchConnector(DCPSystem):
    """s3torchconnector's DCP writer/reader. Options: ``part_size`` and
    ``throughput_target_gbps`` go to its ``S3ClientConfig`` (writer and reader),
    ``reader_constructor`` (``dcp_optimized``, ``sequential``, ``range_based``: the
    ``S3ReaderConstructor`` of that name) to ``S3StorageReader``, the rest
    (``thread_count``, ...) to ``S3StorageWriter``."""

    name = "s3torchconnector"
    kinds = ("s3",)
    requires = ("s3torchconnector", "s3torchconnectorclient")
    description = "s3torchconnector S3StorageWriter / S3StorageReader (default reader)"
    client_stack = "crt"
    grid = Grid({"thread_count": GRID_THREADS, "part_size": GRID_PART_SIZES},
                single={"reader_constructor": GRID_S3TC_READERS,
                        "throughput_target_gbps": GRID_S3TC_THROUGHPUT})
    reader_keys = frozenset({"part_size", "reader_constructor", "throughput_target_gbps"})
    defaults = {"thread_count": 1, "part_size": 8 * _MiB,
                "reader_constructor": GRID_S3TC_READERS[0],
                "throughput_target_gbps": GRID_S3TC_THROUGHPUT[0]}
    _CLIENT_KEYS: ClassVar[tuple[str, ...]] = ("part_size", "throughput_target_gbps")
    #: Options of the reader only (the writer ignores them).
    _READER_KEYS: ClassVar[tuple[str, ...]] = ("reader_constructor",)

    def settings(self) -> dict[str, str]:
        return dict(CRT_SETTINGS)

    def _config(self, ctx: OpContext) -> Any:
        from s3torchconnector import S3ClientConfig

        client = {k: ctx.options[k] for k in self._CLIENT_KEYS if k in ctx.options}
        if "part_size" in client:
            client["part_size"] = int(client["part_size"])
        if "throughput_target_gbps" in client:
            client["throughput_target_gbps"] = float(client["throughput_target_gbps"])
        return S3ClientConfig(force_path_style=True, **client)

    def writer(self, ctx: OpContext) -> Any:
        from s3torchconnector.dcp import S3StorageWriter

        rest = {k: v for k, v in ctx.options.items()
                if k not in self._CLIENT_KEYS and k not in self._READER_KEYS}
        # the endpoint comes from AWS_ENDPOINT_URL (see environment())
        return S3StorageWriter(ctx.store.region, f"s3://{ctx.store.root}/{ctx.path}",
                               s3client_config=self._config(ctx), **rest)

    @staticmethod
    def reader_constructor(kind: str | None) -> Any:
        """The ``S3ReaderConstructor`` called ``kind`` (``None``: the reader's default).

        Raises:
            ValueError: This s3torchconnector has no reader of that name.
        """
        if kind is None:
            return None
        from s3torchconnector import S3ReaderConstructor

        make = getattr(S3ReaderConstructor, kind, None) if kind in GRID_S3TC_READERS else None
        if make is None:
            raise ValueError(f"s3torchconnector: no reader_constructor {kind!r} (one of "
                             f"{', '.join(GRID_S3TC_READERS)})")
        return make()

    def reader(self, ctx: OpContext) -> Any:
        from s3torchconnector.dcp import S3StorageReader

        extra: dict[str, Any] = {}
        constructor = self.reader_constructor(ctx.options.get("reader_constructor"))
        if constructor is not None:
            extra["reader_constructor"] = constructor
        return S3StorageReader(ctx.store.region, f"s3://{ctx.store.root}/{ctx.path}",
                               s3client_config=self._config(ctx), **extra)


class MSC(DCPSystem):
    """multi-storage-client's DCP writer/reader. Options: ``part_size`` picks the MSC
    profile whose ``multipart_threshold`` and ``multipart_chunksize`` are that size
    (written by :class:`benchmarks.servers.Stores`); ``thread_count`` goes to the writer
    and the reader, the rest to the writer."""

    name = "msc"
    kinds = ("s3",)
    requires = ("multistorageclient",)
    description = "multi-storage-client MultiStorageFileSystemWriter / Reader"
    client_stack = "msc"
    grid = {"thread_count": GRID_THREADS, "part_size": GRID_PART_SIZES}
    reader_keys = frozenset({"thread_count", "part_size"})
    # part_size is not among them: the default profile is MSC's own (64 MiB threshold,
    # 32 MiB parts)
    defaults = {"thread_count": 1}

    @staticmethod
    def _url(ctx: OpContext) -> str:
        part = ctx.options.get("part_size")
        profile = ctx.store.msc_profile or ""
        if part is not None:
            profile = msc_part_profile(profile, int(part))
        return f"msc://{profile}/{ctx.path}"

    def writer(self, ctx: OpContext) -> Any:
        from multistorageclient.contrib.torch import MultiStorageFileSystemWriter

        rest = {k: v for k, v in ctx.options.items() if k != "part_size"}
        return MultiStorageFileSystemWriter(self._url(ctx), **rest)

    def reader(self, ctx: OpContext) -> Any:
        from multistorageclient.contrib.torch import MultiStorageFileSystemReader

        threads = {k: ctx.options[k] for k in ("thread_count",) if k in ctx.options}
        return MultiStorageFileSystemReader(self._url(ctx), **threads)




# -- registry ------------------------------------------------------------------------------

# the limits live in benchmarks/limits.py, the stall suite's systems in
# benchmarks/stall_systems.py: both build on benchmarks.adapters, not on this module
_SYSTEMS: dict[str, type[System]] = {cls.name: cls for cls in (
    DcpstoreLocal, TorchFS, LimitLocal,
    DcpstoreS3, TorchFsspecS3, S3TorchConnector, MSC, DcpstoreMSC, LimitS3,
    DcpstoreGCS, TorchFsspecGCS, LimitGCS,
)}

#: Systems run on each kind of store, in the order they are interleaved and reported.
DEFAULT_SYSTEMS: dict[str, list[str]] = {
    kind: [name for name, cls in _SYSTEMS.items() if kind in cls.kinds]
    for kind in ("local", "s3", "gcs")
}


#: Labels of the stall suite's systems (:mod:`benchmarks.stall_systems`) start with this.
STALL_PREFIX = "stall:"


def get(label: str) -> System:
    """The system called ``label`` (``name`` or ``name[variant]``).

    Raises:
        KeyError: No such system.
    """
    if label.startswith(STALL_PREFIX):  # the stall suite's systems (benchmarks.stall)
        return stall_systems.get(label[len(STALL_PREFIX):])
    name, variant = split_variant(label)
    if name not in _SYSTEMS:
        raise KeyError(f"unknown system {name!r}; known: {', '.join(_SYSTEMS)}")
    cls = _SYSTEMS[name]
    if issubclass(cls, LimitSystem):
        return cls(variant)
    if variant == "best" and cls.is_dcpstore:
        # dcpstore runs at its defaults; a bracket of options is an A/B variant of them
        # (``dcpstore-s3[adaptive_concurrency=false]``), never judged by the targets
        raise KeyError(f"system {name!r} has no tuned best (dcpstore runs at its defaults)")
    system = cls(variant)
    if variant:
        try:
            system.variant_options()
        except ValueError as exc:
            raise KeyError(str(exc)) from None
    return system


def names() -> list[str]:
    """Every system name."""
    return list(_SYSTEMS)
