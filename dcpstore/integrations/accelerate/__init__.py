"""HF Accelerate: ``save_state`` / ``load_state`` of FSDP2 sharded checkpoints through dcpstore.

Accelerate 1.15's ``fsdp_utils`` hard-code ``FileSystemWriter(dir)`` / ``FileSystemReader(dir)``
and every other part of a checkpoint goes through ``os.makedirs``, ``pathlib`` and
``shutil.rmtree``; an ``s3://`` directory ends up as a local tree named ``s3:``. The user's
change here is one class:

>>> from dcpstore.integrations.accelerate import DcpstoreAccelerator
>>> accelerator = DcpstoreAccelerator(fsdp_plugin=plugin)      # instead of Accelerator(...)
>>> accelerator.save_state("s3://bucket/run7/step-100")
>>> accelerator.load_state("s3://bucket/run7/step-100")

How a save works:

- the model and optimizer shards (FSDP2, ``SHARDED_STATE_DICT``) stream through
  ``dcpstore.get_writer`` into ``<dir>/pytorch_model_fsdp_<i>`` and ``<dir>/optimizer_<i>``,
  the directory names Accelerate uses, in DCP's own layout;
- everything else Accelerate (or a save hook) writes (scheduler, sampler, scaler, RNG states,
  custom objects) is written by Accelerate's own code into a private scratch directory and
  then stored with the backend's ``put``;
- when every rank succeeded, the main process puts a commit marker
  (:data:`COMMIT_MARKER`). A directory without it is not a checkpoint: ``load_state`` refuses
  it and "latest" never names it;
- with ``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=N)`` the
  ``checkpoints/checkpoint_<n>`` directories live on the store, and the oldest committed ones
  beyond ``N`` are deleted through the backend only after the new one committed.

Local paths go through dcpstore too (its local backend), so a local checkpoint has the same
commit marker and integrity manifests; its DCP directories still load with torch's
``FileSystemReader`` and stock Accelerate.

The integration swaps Accelerate's four ``fsdp_utils`` save/load functions in the
``accelerate.accelerator`` (and ``transformers.trainer``) module namespaces for the
duration of one ``save_state`` / ``load_state`` call. It checks the installed version and
those names first and refuses with :class:`UnsupportedVersionError` where they differ.

The modules: :mod:`~dcpstore.integrations.accelerate.accelerator` (the Accelerator),
:mod:`~dcpstore.integrations.accelerate.scratch` (saving through a scratch directory,
shared with the HF Trainer), :mod:`~dcpstore.integrations.accelerate.fsdp` (the
``fsdp_utils`` redirect), :mod:`~dcpstore.integrations.accelerate.versions` (the
supported releases), :mod:`~dcpstore.integrations.accelerate.store` (committed
checkpoints on a store) and :mod:`~dcpstore.integrations.accelerate.uris`.
"""

from __future__ import annotations

from dcpstore.integrations.accelerate.accelerator import DcpstoreAccelerator
from dcpstore.integrations.accelerate.fsdp import redirected as redirected
from dcpstore.integrations.accelerate.scratch import download_extras as download_extras
from dcpstore.integrations.accelerate.scratch import save_with_scratch as save_with_scratch
from dcpstore.integrations.accelerate.scratch import scratch_dir as scratch_dir
from dcpstore.integrations.accelerate.store import (
    COMMIT_MARKER,
    is_committed,
    latest_checkpoint,
    list_checkpoints,
)
from dcpstore.integrations.accelerate.store import require_committed as require_committed
from dcpstore.integrations.accelerate.store import rotate as rotate
from dcpstore.integrations.accelerate.uris import check_uri, join_uri
from dcpstore.integrations.accelerate.uris import is_remote as is_remote
from dcpstore.integrations.accelerate.versions import (
    SUPPORTED_ACCELERATE,
    UnsupportedVersionError,
)
from dcpstore.integrations.accelerate.versions import _version_tuple as _version_tuple
from dcpstore.integrations.accelerate.versions import check_accelerate as check_accelerate

__all__ = [
    "COMMIT_MARKER",
    "SUPPORTED_ACCELERATE",
    "DcpstoreAccelerator",
    "UnsupportedVersionError",
    "check_uri",
    "is_committed",
    "join_uri",
    "latest_checkpoint",
    "list_checkpoints",
]
