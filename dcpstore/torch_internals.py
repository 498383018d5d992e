"""Every private torch name dcpstore uses, in the one module that knows torch's releases.

DCP's storage interfaces are public. Still, a storage layer that writes torch's own
file format, reads it back without a copy, and plugs into DCP's choice of storage needs
a few private names. They are imported here and nowhere else in dcpstore (a test walks
the package to check). Each comes with what it is for. ``tests/test_torch_internals.py``
checks each one on every torch release of the matrix (``make test-matrix``), from
:data:`TORCH_FLOOR` to the newest.

- :data:`StorageInfo` (``checkpoint.filesystem._StorageInfo``): the ``.metadata``
  record of where an item's bytes lie; torch's readers need this very class.
- :data:`StorageReaderTransforms` / :data:`StorageWriterTransforms`
  (``checkpoint.filesystem._Storage*Transforms``): DCP stream extensions such as
  ZStandard, recorded as torch's writers record them.
- :func:`element_size` (``torch._utils._element_size``): bytes per element of any dtype.
- :func:`narrow_tensor_by_index` (``distributed._shard._utils``): the part of a saved
  chunk that a resharded load needs.
- :func:`restricted_unpickler` (``torch._weights_only_unpickler.Unpickler``):
  ``weights_only`` unpickling of a tensor archive read in place.
- :func:`tensor_archive_writer` / :func:`write_tensor_archive` (``torch._C.PyTorchFileWriter``,
  ``serialization._save``): ``torch.save``'s archive without its CRC32 pass.
- :func:`local_tensor` / :func:`dtensor_like` (``DTensor._local_tensor``, ``._spec``):
  staging a DTensor's shard without a copy, and wrapping the staged copy.
- :func:`dcp_storage_setup` (``checkpoint._storage_utils._storage_setup``): DCP
  routing's hook point (:mod:`dcpstore.integrations.dcp_routing`).
- :func:`zstandard_extension` (``checkpoint._extension.ZStandard``): the conformance
  suite's stream-extension check.
- :func:`group_timeout` (``ProcessGroup._get_backend(device).options._timeout``): the
  timeout of a process group, which the gloo side groups dcpstore makes inherit
  (``new_group`` defaults to 30 minutes whatever the parent's: a rank whose peer's
  host died would wait that long).

It also knows where releases disagree on the checkpoint format itself:
:func:`portable_metadata_bytes` pickles ``.metadata`` in the form every supported
release reads (torch 2.15 added a sixth field, ``strides``, to ``TensorProperties``'
pickled state, which torch 2.14 and older cannot unpack).
"""

from __future__ import annotations

import importlib
import pickle
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch

from dcpstore._version import TORCH_FLOOR as _FLOOR
from dcpstore._version import check_torch_floor, release

__all__ = [
    "TORCH_FLOOR",
    "StorageInfo",
    "StorageReaderTransforms",
    "StorageWriterTransforms",
    "check_torch_version",
    "dcp_storage_setup",
    "dtensor_like",
    "element_size",
    "group_timeout",
    "local_tensor",
    "narrow_tensor_by_index",
    "portable_metadata_bytes",
    "restricted_unpickler",
    "storage_alignment",
    "tensor_archive_writer",
    "torch_version",
    "write_tensor_archive",
    "zstandard_extension",
]

#: The oldest torch release dcpstore supports (see :mod:`dcpstore._version`).
TORCH_FLOOR = _FLOOR


def torch_version(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the running torch's)."""
    return release(version if version is not None else torch.__version__)


def check_torch_version(version: str | None = None) -> None:
    """Raise ``ImportError`` naming the floor if ``version`` (default: the running
    torch's) is older than :data:`TORCH_FLOOR`."""
    check_torch_floor(version if version is not None else torch.__version__)


check_torch_version()

from torch.distributed._shard._utils import narrow_tensor_by_index  # noqa: E402
from torch.distributed.checkpoint.filesystem import (  # noqa: E402
    _StorageInfo,
    _StorageReaderTransforms,
    _StorageWriterTransforms,
)

#: Where an item's bytes lie in a data file (``relative_path``, ``offset``, ``length``,
#: ``transform_descriptors``): the record torch's readers expect in ``.metadata``.
StorageInfo = _StorageInfo
#: Decoders of DCP's stream extensions, given the extension registry.
StorageReaderTransforms = _StorageReaderTransforms
#: Encoders of DCP's stream extensions, given the writer's extensions.
StorageWriterTransforms = _StorageWriterTransforms


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (every dtype, including quantized and bit ones)."""
    return int(torch._utils._element_size(dtype))


def restricted_unpickler(stream: Any) -> Any:
    """torch's ``weights_only`` unpickler over ``stream`` (tensors, storages and plain
    containers only; set its ``persistent_load``)."""
    from torch import _weights_only_unpickler

    return _weights_only_unpickler.Unpickler(stream, encoding="utf-8")


def storage_alignment() -> int:
    """The alignment of storages in a ``torch.save`` archive."""
    serialization: Any = torch.serialization
    return int(serialization._get_storage_alignment())


def tensor_archive_writer(stream: Any) -> Any:
    """torch's archive writer over ``stream`` (``torch.save``'s, without its CRC32 pass;
    dcpstore keeps CRC32C). Fill it with :func:`write_tensor_archive`, then call its
    ``write_end_of_file()``, on failure too."""
    return torch._C.PyTorchFileWriter(stream, False, storage_alignment())


def write_tensor_archive(tensor: torch.Tensor, writer: Any) -> None:
    """``torch.save(tensor)``'s records into ``writer`` (see :func:`tensor_archive_writer`)."""
    serialization: Any = torch.serialization
    serialization._save(tensor, writer, pickle, serialization.DEFAULT_PROTOCOL, False)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself for any other tensor), without a copy
    or a collective."""
    return getattr(tensor, "_local_tensor", tensor)


def dtensor_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor with ``like``'s mesh, placements and global shape, without
    a copy or a collective (``like`` is a DTensor)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)  # type: ignore[attr-defined]


#: DCP's hook point: the function ``dcp.save`` / ``dcp.load`` call to pick the storage
#: writer or reader of a ``checkpoint_id``, and the parameters it takes.
STORAGE_SETUP_MODULE = "torch.distributed.checkpoint._storage_utils"
STORAGE_SETUP_NAME = "_storage_setup"
STORAGE_SETUP_PARAMS = ["storage", "checkpoint_id", "reader"]


def dcp_storage_setup() -> ModuleType:
    """The module that holds DCP's ``_storage_setup`` (see :data:`STORAGE_SETUP_NAME`)."""
    return importlib.import_module(STORAGE_SETUP_MODULE)


def zstandard_extension() -> Any:
    """A DCP ``ZStandard`` stream extension."""
    from torch.distributed.checkpoint._extension import ZStandard

    return ZStandard()


#: Fields of ``TensorProperties``' pickled state that every supported release reads:
#: dtype, layout, requires_grad, memory format, pin_memory. torch 2.15 appends
#: ``strides`` (reading 5 or 6); older releases unpack exactly these 5.
_PORTABLE_TENSOR_PROPERTIES = 5


def _portable_tensor_properties(props: Any) -> tuple[Any, ...]:
    import copyreg

    state = props.__getstate__()
    # strides only describe the saved tensor's layout: DCP loads into the destination's
    return (copyreg.__newobj__, (type(props),),  # type: ignore[attr-defined]
            tuple(state[:_PORTABLE_TENSOR_PROPERTIES]))


def portable_metadata_bytes(metadata: Any) -> bytes:
    """``pickle.dumps(metadata)`` of a DCP ``Metadata``, readable by every torch release
    dcpstore supports: ``TensorProperties`` keep their first 5 fields (torch 2.15's
    ``strides`` is left out; a 2.15 reader sets it to ``None``, as for older files)."""
    import copyreg
    import io

    from torch.distributed.checkpoint.metadata import TensorProperties

    buf = io.BytesIO()
    pickler = pickle.Pickler(buf)
    table = copyreg.dispatch_table.copy()
    table[TensorProperties] = _portable_tensor_properties
    pickler.dispatch_table = table
    pickler.dump(metadata)
    return buf.getvalue()


def group_timeout(group: Any = None) -> timedelta | None:
    """The timeout ``group`` (default: the world) was made with; ``None`` where this
    release does not say (then a new group gets torch's default)."""
    import torch.distributed as dist

    try:
        pg: Any = dist.group.WORLD if group is None else group
        device = "cuda" if dist.get_backend(pg) == "nccl" else "cpu"
        timeout = pg._get_backend(torch.device(device)).options._timeout
    except Exception:
        return None
    return timeout if isinstance(timeout, timedelta) else None
