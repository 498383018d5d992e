"""The Accelerate releases, and the ``fsdp_utils`` internals, this integration adapts."""

from __future__ import annotations

import re
from types import ModuleType

from dcpstore.errors import DcpstoreError

__all__ = ["SUPPORTED_ACCELERATE", "UnsupportedVersionError", "check_accelerate"]

#: Accelerate releases whose internals this module was checked against: ``[low, high)``.
SUPPORTED_ACCELERATE = ((1, 10), (1, 16))

_FSDP_FUNCTIONS = ("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer",
                   "load_fsdp_optimizer")
_FSDP_HELPERS = ("_prepare_sd_options", "_get_model_state_dict", "_set_model_state_dict")


class UnsupportedVersionError(DcpstoreError, RuntimeError):
    """The installed trainer's internals differ from those this integration adapts."""


def _version_tuple(text: str) -> tuple[int, int]:
    parts = re.findall(r"\d+", text)[:2]
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else (0, 0)


def check_accelerate() -> ModuleType:
    """Import ``accelerate.utils.fsdp_utils`` and check the internals this module adapts.

    Raises:
        UnsupportedVersionError: the version is outside :data:`SUPPORTED_ACCELERATE` or a
            function this module swaps is missing.
    """
    import accelerate
    import accelerate.accelerator
    from accelerate.utils import fsdp_utils

    low, high = SUPPORTED_ACCELERATE
    version = _version_tuple(accelerate.__version__)
    missing = [n for n in _FSDP_HELPERS + _FSDP_FUNCTIONS if not hasattr(fsdp_utils, n)]
    missing += [f"accelerate.accelerator.{n}" for n in _FSDP_FUNCTIONS
                if not hasattr(accelerate.accelerator, n)]
    if not low <= version < high or missing:
        raise UnsupportedVersionError(
            f"dcpstore's Accelerate integration supports accelerate "
            f"{low[0]}.{low[1]}-{high[0]}.{high[1] - 1}.x; found {accelerate.__version__}"
            + (f" without {', '.join(missing)}" if missing else "")
            + ". Install a supported accelerate (see requirements/constraints.txt) or use "
            "dcpstore.get_writer/get_reader with dcp.save/dcp.load directly.")
    return fsdp_utils
