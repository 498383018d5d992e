"""dcpstore: pluggable, streaming, never-torn storage for PyTorch Distributed Checkpoint.

>>> import torch.distributed.checkpoint as dcp, dcpstore
>>> dcp.save(state_dict, storage_writer=dcpstore.get_writer("s3://bucket/run7/step-1200"))
>>> dcp.load(state_dict, storage_reader=dcpstore.get_reader("s3://bucket/run7/step-1200"))

This module exports what a training script needs (:data:`__all__`), loaded on first use,
so ``import dcpstore`` does not import torch. The other audiences have their own modules:

- plugin authors: :mod:`dcpstore.plugin` (the object-store contract, registration);
- errors: :mod:`dcpstore.errors` (one class per kind of failure);
- tests: :mod:`dcpstore.testing` (conformance suite, in-memory and fault backends, servers);
- the layers themselves: :mod:`dcpstore.storage`, :mod:`dcpstore.dcp`,
  :mod:`dcpstore.training`, :mod:`dcpstore.tools`, :mod:`dcpstore.integrations`.

Names that earlier releases exported here (``dcpstore.Backend``, ``dcpstore.Writer``,
``dcpstore.IntegrityError``, ...) and the old module paths (``dcpstore.checkpointer``, ...)
keep working.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dcpstore import _compat
from dcpstore._version import __version__, check_torch_floor

if TYPE_CHECKING:
    from dcpstore.dcp.api import get_reader, get_writer, load, save
    from dcpstore.errors import DcpstoreError
    from dcpstore.integrations.dcp_routing import enable as enable_dcp_routing
    from dcpstore.training.checkpointer import Checkpointer
    from dcpstore.training.state import AppState
    from dcpstore.training.weights import export, load_model_weights

_compat.install()


def _check_torch_floor() -> None:
    """Fail ``import dcpstore`` on a torch older than the floor, naming it (without
    importing torch: the installed release's metadata says which it is)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("torch")
    except PackageNotFoundError:  # no torch: the first use that needs it says so
        return
    check_torch_floor(found)


_check_torch_floor()

__all__ = [
    "AppState",
    "Checkpointer",
    "DcpstoreError",
    "__version__",
    "enable_dcp_routing",
    "export",
    "get_reader",
    "get_writer",
    "load",
    "load_model_weights",
    "save",
]

#: Public name -> ``module:attribute``, imported on first use.
_PUBLIC: dict[str, str] = {
    "AppState": "dcpstore.training.state:AppState",
    "Checkpointer": "dcpstore.training.checkpointer:Checkpointer",
    "DcpstoreError": "dcpstore.errors:DcpstoreError",
    "enable_dcp_routing": "dcpstore.integrations.dcp_routing:enable",
    "export": "dcpstore.training.weights:export",
    "get_reader": "dcpstore.dcp.api:get_reader",
    "get_writer": "dcpstore.dcp.api:get_writer",
    "load": "dcpstore.dcp.api:load",
    "load_model_weights": "dcpstore.training.weights:load_model_weights",
    "save": "dcpstore.dcp.api:save",
}

#: Names earlier releases exported here; still served, not advertised.
_FORMER: dict[str, str] = {
    **{name: f"dcpstore.errors:{name}" for name in (
        "BackendNotFoundError", "BucketNotFoundError", "CheckpointExistsError",
        "CheckpointMismatchError", "CheckpointNotFoundError", "IncompleteCheckpointError",
        "IntegrityError", "InvalidURIError", "ShardingError", "StoreThrottledError",
        "StoreTimeoutError", "UnsafeCheckpointError", "UnsafeKeyError")},
    **{name: f"dcpstore.storage.backend:{name}" for name in (
        "Backend", "BackendOptions", "Failure", "ObjectInfo", "ReadRange", "Upload")},
    **{name: f"dcpstore.training.checkpointer:{name}" for name in (
        "BackgroundWriterDiedError", "CheckpointSaveError", "DrainError", "Step")},
    "LocalBackend": "dcpstore.storage.local:LocalBackend",
    "LocalOptions": "dcpstore.storage.local:LocalOptions",
    "Manifest": "dcpstore.dcp.manifest:Manifest",
    "MultipartUpload": "dcpstore.storage.multipart:MultipartUpload",
    "ReaderOptions": "dcpstore.storage.options:ReaderOptions",
    "WriterOptions": "dcpstore.storage.options:WriterOptions",
    "Reader": "dcpstore.dcp.reader:Reader",
    "Writer": "dcpstore.dcp.writer:Writer",
    "Stager": "dcpstore.dcp.staging:Stager",
    "StagingOptions": "dcpstore.dcp.staging:StagingOptions",
    "available_backends": "dcpstore.storage.registry:available_backends",
    "register_backend": "dcpstore.storage.registry:register_backend",
    "open_backend": "dcpstore.dcp.api:open_backend",
}


_submodule = _compat.submodule_getattr(__name__)


def __getattr__(name: str) -> Any:
    target = _PUBLIC.get(name) or _FORMER.get(name)
    if target is None:  # a subpackage or module: dcpstore.training, dcpstore.errors, ...
        return _submodule(name)
    module, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
