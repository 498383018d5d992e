"""What :class:`~dcpstore.dcp.reader.Reader` and :class:`~dcpstore.dcp.writer.Writer`
share: the backend they are bound to, which checkpoint ids they take, and moving to
another checkpoint on ``reset``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from dcpstore.errors import DcpstoreError
from dcpstore.storage.backend import Backend
from dcpstore.storage.resolve import serves

__all__: list[str] = []


class BoundToBackend:
    """A DCP storage reader or writer over one :class:`~dcpstore.Backend`.

    Args:
        backend: Where the checkpoint is.
        rebind: Function turning another ``checkpoint_id`` given to ``reset`` into a
            backend with the same options (``None``: a ``reset`` cannot move).
    """

    #: How ``reset`` to another location without a ``rebind`` names this object:
    #: ``"this Reader loads from"``.
    _bound_as: ClassVar[str]

    def __init__(self, backend: Backend, rebind: Callable[[str], Backend] | None) -> None:
        super().__init__()
        self.backend = backend
        self._rebind = rebind

    @property
    def checkpoint_id(self) -> str:
        """The URI of the checkpoint (where a reader loads from, a writer saves to)."""
        return self.backend.uri

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Whether ``checkpoint_id`` is a URI some installed backend serves."""
        return serves(checkpoint_id)

    def _move_to(self, checkpoint_id: Any) -> None:
        """Bind to ``checkpoint_id`` (``None`` or the same URI: stay) through ``rebind``,
        which keeps the backend options."""
        if checkpoint_id is not None and str(checkpoint_id) != self.backend.uri:
            if self._rebind is None:
                raise DcpstoreError(
                    f"{self._bound_as} {self.backend.uri}; create one for {checkpoint_id}"
                )
            self.backend = self._rebind(str(checkpoint_id))
