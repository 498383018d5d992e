"""Each save's writer (to the local tier or the root; incremental saves' base) and, in
process mode, the persistent background writer process that the writers hand their
data to.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from dcpstore.dcp.staging import BackgroundWriter, BackgroundWriterDiedError, ProxyWriter, Stager
from dcpstore.dcp.writer import Writer
from dcpstore.storage.resolve import resolve
from dcpstore.training.context import CheckpointerContext
from dcpstore.training.state import frozen_keys

__all__ = ["WriterFactory"]

logger = logging.getLogger(__name__)


class WriterFactory:
    """Makes the writers of a Checkpointer's saves.

    Args:
        context: The Checkpointer's settings, root and collectives.
        stager: The staging memory that a process-mode writer reads from.

    Attributes:
        worker: Process mode: this rank's background writer process, started here so
            that it imports torch while training runs; ``None`` otherwise.
    """

    def __init__(self, context: CheckpointerContext, stager: Stager | None) -> None:
        self._config, self._root, self._collectives = (
            context.config, context.root, context.collectives)
        self._stager = stager
        self._frozen: dict[int, tuple[str, ...]] = {}  # per step being saved
        self.worker: BackgroundWriter | None = None
        if self._config.async_mode == "process":
            self.worker = BackgroundWriter()

    def note_frozen(self, step: int, state: dict[str, Any]) -> None:
        """Incremental saves: remember the keys ``state`` marks frozen for ``step``."""
        self._frozen = {step: frozen_keys(state)}

    def local(self, step: int) -> Writer:
        """A writer of ``step`` to the local tier."""
        path = self._config.local_step_path(step)
        assert path is not None
        os.makedirs(path, exist_ok=True)
        return self._make(path, None, dict(self._root.resolved.writer_options))

    def remote(self, step: int) -> Writer:
        """A writer of ``step`` to the root."""
        resolved = self._root.resolved
        kwargs = {**resolved.backend_kwargs, **resolved.writer_options}
        if self._config.incremental:
            kwargs.update(self._incremental_options(step))
        return self._make(self._config.step_uri(step), self._config.backend_name, kwargs)

    def _incremental_options(self, step: int) -> dict[str, Any]:
        """Writer options of an incremental save of ``step``: its base is the newest
        committed step (only the coordinator's writer reads it)."""
        options: dict[str, Any] = {"frozen": self._frozen.get(step, ()),
                                   "base_required": False}
        if self._collectives.is_coordinator():
            # every rank is about to enter dcp.save: a failure here must not leave the
            # others waiting, and a save without a base is always valid (a full one)
            try:
                newest = self._root.newest()
                if newest == step:  # saving a step again: its base is the one before it
                    older = [s for s in self._root.committed() if s < step]
                    newest = older[-1] if older else None
            except Exception as exc:
                logger.warning("cannot find the base of incremental step %d under %s (%s); "
                               "saving it in full", step, self._config.root_uri, exc)
                newest = None
            if newest is not None:
                options["base"] = self._config.step_uri(newest)
        return options

    def _make(self, uri: str, backend: str | None, kwargs: dict[str, Any]) -> Writer:
        resolved = resolve(uri, backend=backend, role="writer", **kwargs)
        extensions = self._config.extensions
        if self._config.async_mode == "process":
            if self.worker is None or not self.worker.alive():
                raise BackgroundWriterDiedError(
                    "the background writer process is not running; this save is not "
                    "committed (the next save starts a new process)")
            assert self._stager is not None
            self.worker.prepare(resolved)
            return ProxyWriter(resolved.open_backend(), resolved.writer(),
                               extensions=extensions, rebind=resolved.rebind,
                               worker=self.worker, stager=self._stager, resolved=resolved)
        return Writer(resolved.open_backend(), resolved.writer(), extensions=extensions,
                      rebind=resolved.rebind)

    def check_worker(self) -> None:
        """Process mode, before a save (collective): raise on every rank when any
        rank's background process died, starting a new one on those ranks.

        Raises:
            BackgroundWriterDiedError: A rank's background process is gone.
        """
        dead = self.worker is None or not self.worker.alive()
        pid = self.worker.pid if self.worker else None
        dead_ranks = [r for r, d in enumerate(self._collectives.all_gather(dead)) if d]
        if not dead_ranks:
            return
        if dead:
            self.restart_worker()
        raise BackgroundWriterDiedError(
            f"the background writer process of rank(s) {dead_ranks} died since the last "
            f"save (this rank's was pid {pid}); this save was not started and nothing was "
            "committed. Call save() again to use a new background process"
        )

    def restart_worker(self) -> None:
        """Process mode: start a new background process unless this one is alive."""
        if self._config.async_mode != "process":
            return
        if self.worker is not None and self.worker.alive():
            return
        if self.worker is not None:
            self.worker.stop()
        logger.warning("starting a new background writer process")
        self.worker = BackgroundWriter()

    def close(self) -> None:
        """Stop the background process."""
        if self.worker is not None:
            self.worker.stop()
