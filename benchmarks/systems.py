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
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .servers import StoreInfo
from .workload import RankState

__all__ = [
    "DEFAULT_SYSTEMS",
    "OpContext",
    "Operation",
    "System",
    "environment",
    "get",
    "split_variant",
]

logger = logging.getLogger(__name__)

@dataclass
class OpContext:
    """Where and how one rank runs one operation.

    Attributes:
        store: The store (for counted runs: its proxy endpoint / MSC profile).
        path: Checkpoint prefix relative to the store root.
        rank: This rank.
        world_size: Ranks taking part.
        options: Options for the system (``--opt``).
        counted: Whether this is an untimed request-counting run.
    """

    store: StoreInfo
    path: str
    rank: int
    world_size: int
    options: dict[str, Any] = field(default_factory=dict)
    counted: bool = False


@dataclass
class Operation:
    """A prepared save or load.

    Attributes:
        run: The timed part; returns system-specific figures.
        verify: Untimed check after a load (``None``: the harness compares the
            destination state with the expected one).
        close: Untimed clean-up (thread pools, sessions).
    """

    run: Callable[[], dict[str, Any]]
    verify: Callable[[], bool] | None = None
    close: Callable[[], None] | None = None


def environment(ctx: OpContext) -> dict[str, str]:
    """Variables every client gets for this store (credentials, MSC config)."""
    env = dict(ctx.store.env)
    if ctx.store.kind == "s3" and ctx.store.endpoint_url:
        env["AWS_ENDPOINT_URL"] = ctx.store.endpoint_url  # read by s3torchconnector's CRT
    if ctx.store.msc_config:
        env["MSC_CONFIG"] = ctx.store.msc_config
    env.setdefault("NO_PROXY", "127.0.0.1,localhost")
    return env


class System:
    """A system under test. Subclasses set the class attributes and the two hooks."""

    #: Name on the command line and in the results.
    name: ClassVar[str] = ""
    #: Store kinds it runs on (``local``, ``s3``, ``gcs``).
    kinds: ClassVar[tuple[str, ...]] = ()
    #: Modules it needs (a missing one skips the system, with the reason).
    requires: ClassVar[tuple[str, ...]] = ()
    #: A raw-I/O limit rather than a DCP system.
    is_limit: ClassVar[bool] = False
    #: One of dcpstore's own.
    is_dcpstore: ClassVar[bool] = False
    #: One line for the report.
    description: ClassVar[str] = ""

    def __init__(self, variant: str = "") -> None:
        self.variant = variant

    @property
    def label(self) -> str:
        """Name with variant, e.g. ``limit-s3[64MiBx8]``."""
        return f"{self.name}[{self.variant}]" if self.variant else self.name

    def unavailable(self) -> str | None:
        """Why the system cannot run here (a missing package), or ``None``."""
        for module in self.requires:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                return f"python module {module!r} is not installed"
        return None

    def prepare_save(self, ctx: OpContext, state: RankState) -> Operation:
        """Build what the save needs; return it ready to run."""
        raise NotImplementedError

    def prepare_load(self, ctx: OpContext, state: RankState) -> Operation:
        """Build what the load needs (the destination is zeroed); return it ready."""
        raise NotImplementedError


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

    def _options(self, ctx: OpContext, own: type[Any]) -> dict[str, Any]:
        from dcpstore.options import option_names
        from dcpstore.registry import backend_class
        from dcpstore.uri import parse_uri

        backend_cls = backend_class(parse_uri(self.uri(ctx)).scheme)
        allowed = option_names(own) | option_names(backend_cls.Options)
        opts = self.base_options(ctx)
        opts.update({k: v for k, v in ctx.options.items() if k in allowed})
        return opts

    def writer(self, ctx: OpContext) -> Any:
        import dcpstore

        return dcpstore.get_writer(self.uri(ctx), **self._options(ctx, dcpstore.WriterOptions))

    def reader(self, ctx: OpContext) -> Any:
        import dcpstore

        return dcpstore.get_reader(self.uri(ctx), **self._options(ctx, dcpstore.ReaderOptions))

    @staticmethod
    def _backend_figures(obj: Any) -> dict[str, Any]:
        o = obj.backend.options
        figures: dict[str, Any] = {"part_size": int(o.part_size),
                                   "max_concurrency": int(o.max_concurrency)}
        files = getattr(getattr(obj, "options", None), "files_per_rank", None)
        if files is not None:
            figures["files_per_rank"] = int(files)
        counts = getattr(obj.backend, "request_counts", None)
        if counts:
            figures["backend_requests"] = dict(counts)
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
    kinds = ("local",)
    requires = ("dcpstore",)
    description = "dcpstore, local backend (fsync on)"

    def uri(self, ctx: OpContext) -> str:
        return os.path.join(ctx.store.root, ctx.path)


class DcpstoreS3(Dcpstore):
    name = "dcpstore-s3"
    kinds = ("s3",)
    requires = ("dcpstore_s3", "botocore")
    description = "dcpstore, S3 backend (botocore)"

    def uri(self, ctx: OpContext) -> str:
        return f"s3://{ctx.store.root}/{ctx.path}"

    def base_options(self, ctx: OpContext) -> dict[str, Any]:
        return {"endpoint_url": ctx.store.endpoint_url, "region": ctx.store.region}


class DcpstoreMSC(Dcpstore):
    name = "dcpstore-msc"
    kinds = ("s3",)
    requires = ("dcpstore_msc", "multistorageclient")
    description = "dcpstore, MSC backend (same MSC profile as msc)"

    def uri(self, ctx: OpContext) -> str:
        return f"msc://{ctx.store.msc_profile}/{ctx.path}"

    def base_options(self, ctx: OpContext) -> dict[str, Any]:
        return {"config": ctx.store.msc_config}


class DcpstoreGCS(Dcpstore):
    name = "dcpstore-gcs"
    kinds = ("gcs",)
    requires = ("dcpstore_gcs", "gcsfs")
    description = "dcpstore, GCS backend"

    def uri(self, ctx: OpContext) -> str:
        return f"gs://{ctx.store.root}/{ctx.path}"

    def base_options(self, ctx: OpContext) -> dict[str, Any]:
        return {"endpoint_url": ctx.store.endpoint_url, "token": "anon"}


class TorchFS(DCPSystem):
    name = "torch-fs"
    kinds = ("local",)
    description = "torch FileSystemWriter(sync_files=True) / FileSystemReader"

    def writer(self, ctx: OpContext) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter

        opts = {"sync_files": True, **ctx.options}
        return FileSystemWriter(os.path.join(ctx.store.root, ctx.path), **opts)

    def reader(self, ctx: OpContext) -> Any:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(os.path.join(ctx.store.root, ctx.path))


class TorchFsspec(DCPSystem):
    """torch's fsspec writer/reader (``sync_files=False``: object stores have no fsync,
    and torch would fall back to a machine-wide ``os.sync()``)."""

    protocol: ClassVar[str] = ""

    def storage_options(self, ctx: OpContext) -> dict[str, Any]:
        """fsspec filesystem keyword arguments."""
        raise NotImplementedError

    def _uri(self, ctx: OpContext) -> str:
        return f"{self.protocol}://{ctx.store.root}/{ctx.path}"

    def writer(self, ctx: OpContext) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        opts = {"sync_files": False, **self.storage_options(ctx), **ctx.options}
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

    def storage_options(self, ctx: OpContext) -> dict[str, Any]:
        return {"endpoint_url": ctx.store.endpoint_url,
                "client_kwargs": {"region_name": ctx.store.region}}


class TorchFsspecGCS(TorchFsspec):
    name = "torch-fsspec-gcs"
    kinds = ("gcs",)
    requires = ("gcsfs",)
    protocol = "gs"
    description = "torch FsspecWriter / FsspecReader over gcsfs"

    def storage_options(self, ctx: OpContext) -> dict[str, Any]:
        return {"endpoint_url": ctx.store.endpoint_url, "token": "anon"}


class S3TorchConnector(DCPSystem):
    name = "s3torchconnector"
    kinds = ("s3",)
    requires = ("s3torchconnector", "s3torchconnectorclient")
    description = "s3torchconnector S3StorageWriter / S3StorageReader (default reader)"

    def _config(self) -> Any:
        from s3torchconnector import S3ClientConfig

        return S3ClientConfig(force_path_style=True)

    def writer(self, ctx: OpContext) -> Any:
        from s3torchconnector.dcp import S3StorageWriter

        # the endpoint comes from AWS_ENDPOINT_URL (see environment())
        return S3StorageWriter(ctx.store.region, f"s3://{ctx.store.root}/{ctx.path}",
                               s3client_config=self._config(), **ctx.options)

    def reader(self, ctx: OpContext) -> Any:
        from s3torchconnector.dcp import S3StorageReader

        return S3StorageReader(ctx.store.region, f"s3://{ctx.store.root}/{ctx.path}",
                               s3client_config=self._config())


class MSC(DCPSystem):
    name = "msc"
    kinds = ("s3",)
    requires = ("multistorageclient",)
    description = "multi-storage-client MultiStorageFileSystemWriter / Reader"

    def writer(self, ctx: OpContext) -> Any:
        from multistorageclient.contrib.torch import MultiStorageFileSystemWriter

        return MultiStorageFileSystemWriter(f"msc://{ctx.store.msc_profile}/{ctx.path}",
                                            **ctx.options)

    def reader(self, ctx: OpContext) -> Any:
        from multistorageclient.contrib.torch import MultiStorageFileSystemReader

        return MultiStorageFileSystemReader(f"msc://{ctx.store.msc_profile}/{ctx.path}")


# -- raw limits ----------------------------------------------------------------------------


def split_variant(label: str) -> tuple[str, str]:
    """``"limit-s3[64MiBx8]"`` -> ``("limit-s3", "64MiBx8")``; no bracket -> ``(label, "")``."""
    m = re.fullmatch(r"([^\[\]]+)(?:\[([^\[\]]*)\])?", label)
    if m is None:
        raise ValueError(f"bad system name {label!r}")
    return m.group(1), m.group(2) or ""


# -- registry ------------------------------------------------------------------------------

# the limits live in benchmarks/limits.py (it imports the classes above)
from .limits import LimitGCS, LimitLocal, LimitS3, LimitSystem  # noqa: E402

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
        from .stall_systems import get as get_stall

        return get_stall(label[len(STALL_PREFIX):])
    name, variant = split_variant(label)
    if name not in _SYSTEMS:
        raise KeyError(f"unknown system {name!r}; known: {', '.join(_SYSTEMS)}")
    cls = _SYSTEMS[name]
    if variant and not issubclass(cls, LimitSystem):
        raise KeyError(f"system {name!r} has no variants")
    return cls(variant) if variant or issubclass(cls, LimitSystem) else cls()


def names() -> list[str]:
    """Every system name."""
    return list(_SYSTEMS)
