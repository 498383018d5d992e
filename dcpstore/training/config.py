"""What a :class:`~dcpstore.training.checkpointer.Checkpointer` was asked to do, checked
once: :func:`checkpointer_config` turns its arguments into a :class:`CheckpointerConfig`
that every part of the Checkpointer reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from dcpstore.training.latest import step_dir

__all__ = ["AsyncMode", "CheckpointerConfig", "DrainPolicy", "checkpointer_config"]

AsyncMode = Literal["thread", "process"] | None
DrainPolicy = Literal["latest", "every"]

#: Options the Checkpointer hands to its writers as they are, not to ``resolve``.
_EXTENSION_KEYS = ("_extensions", "_extension_registry")


@dataclass
class CheckpointerConfig:
    """A Checkpointer's settings (see :class:`~dcpstore.Checkpointer` for each).

    The Checkpointer's attributes of the same names read and write these fields.

    Attributes:
        given: ``options`` without the writer extension hooks: what the root's URI is
            resolved with.
        extensions: The writer extensions passed as ``_extensions``, if any.
        extension_registry: The reader extension registry passed as
            ``_extension_registry``, if any.
    """

    root_uri: str
    keep_last: int | None = None
    keep_last_local: int | None = 1
    local_replicas: int = 1
    async_mode: AsyncMode = None
    local_tier: str | None = None
    drain_retries: int = 2
    drain_policy: DrainPolicy = "latest"
    incremental: bool = False
    backend_name: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    given: dict[str, Any] = field(default_factory=dict)
    extensions: Any = None
    extension_registry: Any = None

    def step_uri(self, step: int) -> str:
        """URI of the checkpoint of ``step`` at the root."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return f"{self.root_uri}/{step_dir(step)}"

    def local_step_path(self, step: int) -> str | None:
        """Path of ``step`` in the local tier (``None`` without one)."""
        if self.local_tier is None:
            return None
        return os.path.join(self.local_tier, step_dir(step))


def checkpointer_config(
    root_uri: str,
    *,
    keep_last: int | None,
    async_mode: AsyncMode,
    staging: Any,
    local_tier: str | os.PathLike[str] | None,
    keep_last_local: int | None,
    local_replicas: int,
    drain_retries: int,
    drain_policy: DrainPolicy,
    incremental: bool,
    backend: str | None,
    options: dict[str, Any],
) -> CheckpointerConfig:
    """Check a Checkpointer's arguments and return its settings.

    ``staging`` is only checked here (async saves need it); the store options are
    checked when the root is resolved.

    Raises:
        ValueError: An argument is out of range, or two of them cannot be combined.
    """
    if incremental and local_tier:
        raise ValueError(
            "incremental=True cannot be combined with local_tier: a local step would "
            "reference local siblings that the drain does not copy to the root, and a "
            "remote step's references must point at remote siblings. Use one of the two"
        )
    if {"base", "base_required", "frozen"} & set(options):
        raise ValueError("the Checkpointer picks the base of each save itself (the "
                         "newest committed step, with incremental=True) and takes "
                         "frozen keys from AppState(frozen_hint=True); do not pass "
                         "base=, base_required= or frozen=")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if keep_last_local is not None and keep_last_local < 1:
        raise ValueError(f"keep_last_local must be >= 1 or None, got {keep_last_local}")
    if async_mode not in (None, "thread", "process"):
        raise ValueError(f"async_mode must be None, 'thread' or 'process', got {async_mode!r}")
    if local_replicas < 0:
        raise ValueError(f"local_replicas must be >= 0, got {local_replicas}")
    if drain_retries < 0:
        raise ValueError(f"drain_retries must be >= 0, got {drain_retries}")
    if drain_policy not in ("latest", "every"):
        raise ValueError(f"drain_policy must be 'latest' or 'every', got {drain_policy!r}")
    if async_mode is not None and staging is False:
        raise ValueError("async saves need staging (the snapshot save() returns after); "
                         "leave staging=None or pass StagingOptions")
    return CheckpointerConfig(
        root_uri=str(root_uri).rstrip("/"),
        keep_last=keep_last,
        keep_last_local=keep_last_local,
        local_replicas=local_replicas,
        async_mode=async_mode,
        local_tier=os.path.abspath(os.fspath(local_tier)) if local_tier else None,
        drain_retries=drain_retries,
        drain_policy=drain_policy,
        incremental=incremental,
        backend_name=backend,
        options=options,
        given={k: v for k, v in options.items() if k not in _EXTENSION_KEYS},
        extensions=options.get("_extensions"),
        extension_registry=options.get("_extension_registry"),
    )
