"""What every part of a :class:`~dcpstore.training.checkpointer.Checkpointer` shares:
its settings, the run's root and its collectives."""

from __future__ import annotations

from dataclasses import dataclass

from dcpstore.training.collectives import Collectives
from dcpstore.training.config import CheckpointerConfig
from dcpstore.training.root import Root

__all__ = ["CheckpointerContext"]


@dataclass(frozen=True)
class CheckpointerContext:
    """The settings, root and collectives of one Checkpointer.

    Attributes:
        config: The Checkpointer's settings.
        root: The run's root.
        collectives: The Checkpointer's collectives.
    """

    config: CheckpointerConfig
    root: Root
    collectives: Collectives
