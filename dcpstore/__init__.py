"""dcpstore: pluggable, streaming, never-torn storage for PyTorch Distributed Checkpoint.

>>> import torch.distributed.checkpoint as dcp, dcpstore
>>> dcp.save(state_dict, storage_writer=dcpstore.get_writer("s3://bucket/run7/step-1200"))
>>> dcp.load(state_dict, storage_reader=dcpstore.get_reader("s3://bucket/run7/step-1200"))
"""

from __future__ import annotations

from ._version import __version__
from .api import get_reader, get_writer, load, open_backend, save
from .backend import Backend, BackendOptions, Failure, ObjectInfo, ReadRange, Upload
from .checkpointer import (
    BackgroundWriterDiedError,
    Checkpointer,
    CheckpointSaveError,
    DrainError,
    Step,
)
from .errors import (
    BackendNotFoundError,
    BucketNotFoundError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    DcpstoreError,
    IncompleteCheckpointError,
    IntegrityError,
    InvalidURIError,
    ShardingError,
    StoreThrottledError,
    StoreTimeoutError,
    UnsafeCheckpointError,
    UnsafeKeyError,
)
from .integrations.dcp_routing import enable as enable_dcp_routing
from .local import LocalBackend, LocalOptions
from .manifest import Manifest
from .multipart import MultipartUpload
from .options import ReaderOptions, WriterOptions
from .reader import Reader
from .registry import available_backends, register_backend
from .staging import Stager, StagingOptions
from .state import AppState
from .weights import export, load_model_weights
from .writer import Writer

__all__ = [
    "AppState",
    "Backend",
    "BackendNotFoundError",
    "BackendOptions",
    "BackgroundWriterDiedError",
    "BucketNotFoundError",
    "CheckpointExistsError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "Checkpointer",
    "DcpstoreError",
    "DrainError",
    "Failure",
    "IncompleteCheckpointError",
    "IntegrityError",
    "InvalidURIError",
    "LocalBackend",
    "LocalOptions",
    "Manifest",
    "MultipartUpload",
    "ObjectInfo",
    "ReadRange",
    "Reader",
    "ReaderOptions",
    "ShardingError",
    "Stager",
    "StagingOptions",
    "Step",
    "StoreThrottledError",
    "StoreTimeoutError",
    "UnsafeCheckpointError",
    "UnsafeKeyError",
    "Upload",
    "Writer",
    "WriterOptions",
    "__version__",
    "available_backends",
    "enable_dcp_routing",
    "export",
    "get_reader",
    "get_writer",
    "load",
    "load_model_weights",
    "open_backend",
    "register_backend",
    "save",
]
