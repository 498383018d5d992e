"""The load path: which step is loaded, and from where (the local tier when every rank
holds a whole copy of it, else the root).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from dcpstore.dcp.api import load
from dcpstore.errors import CheckpointNotFoundError, DcpstoreError
from dcpstore.storage.resolve import reader_option_values, resolve
from dcpstore.training.context import CheckpointerContext
from dcpstore.training.host_tier import spread_commit, step_holders
from dcpstore.training.steps import StepListing

__all__ = ["Loader"]

logger = logging.getLogger(__name__)


class Loader:
    """Loads steps (``load`` is collective).

    Args:
        context: The Checkpointer's settings, root and collectives.
        listing: The step listing (the newest step when none is asked for).

    Attributes:
        last_load: See :attr:`Checkpointer.last_load`.
    """

    def __init__(self, context: CheckpointerContext, listing: StepListing) -> None:
        self._config, self._root, self._collectives = (
            context.config, context.root, context.collectives)
        self._listing = listing
        self.last_load: dict[str, Any] = {}

    def load(self, state: dict[str, Any], step: int | None, options: dict[str, Any]) -> int:
        """Load ``step`` (``None``: the newest) into ``state``; return the step (see
        :meth:`Checkpointer.load`)."""
        started = time.perf_counter()
        if step is not None and step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self._config.local_tier is None:
            if step is None:
                at_root = self._listing.agreed_latest()  # every rank loads the same
                if at_root is None:
                    raise self._not_found()
                return self._load_remote(state, int(at_root), started, options)
            return self._load_remote(state, step, started, options)

        # the root listing (step=None only) overlaps the local load
        listing: Future[list[int]] | None = None
        if step is None and self._collectives.is_coordinator():
            listing = Future()
            # resolving the root (importing its client library) happens on that thread too
            threading.Thread(target=_fill, args=(listing, self._newest_at_root),
                             name="dcpstore-list", daemon=True).start()
        listed = self._listing.local_any(step)
        # newest first; a step no host holds whole is passed over for the next one (a
        # cheap check: only the first whole step is read)
        candidates = sorted(listed, reverse=True) if step is None else [step]
        candidate: int | None = None  # the step whose local read failed, if one did
        loaded: int | None = None
        local_error: BaseException | None = None
        for tried in (c for c in candidates if c in listed):
            try:
                if self._load_local(state, tried, options):
                    loaded = tried
                    break
            except DcpstoreError as exc:
                candidate, local_error = tried, exc
                break

        if step is not None:
            if loaded is not None:
                return self._loaded(step, "local", started)
            if local_error is not None and not self._collectives.on_coordinator(
                    lambda: self._root.has(step), self._root.failure):
                raise local_error
            return self._load_remote(state, step, started, options)

        remote = set(self._collectives.share(
            listing.result if listing is not None else None,
            f"listing {self._config.root_uri} on the coordinator failed"))
        newest = max(remote | {loaded if loaded is not None else -1}
                     | ({candidate} if candidate is not None else set()))
        if newest < 0:
            raise self._not_found()
        if loaded is not None and loaded == newest:
            return self._loaded(loaded, "local", started)
        if newest not in remote and local_error is not None:
            raise local_error  # the newest step is local only, and its read failed
        if loaded is not None:
            logger.info("step %d is newer at %s than the local tier's %d; loading it",
                        newest, self._config.root_uri, loaded)
        return self._load_remote(state, newest, started, options)

    def _newest_at_root(self) -> list[int]:
        found = self._root.newest()
        return [] if found is None else [found]

    def _not_found(self) -> CheckpointNotFoundError:
        tier = self._config.local_tier
        return CheckpointNotFoundError(
            f"no committed checkpoint under {self._config.root_uri}"
            + (f" or {tier}" if tier else "")
            + "; start from scratch or check the root URI"
        )

    def _load_local(self, state: dict[str, Any], step: int, options: dict[str, Any]) -> bool:
        """Load ``step`` from the local tier (collective). ``False`` (nothing read) when
        some file of the step is whole on no host; raises when the read fails (a CRC32C
        mismatch too). Each file is read on a host that holds it
        (:func:`~dcpstore.training.host_tier.step_holders`)."""
        path = self._config.local_step_path(step)
        assert path is not None
        # resolved once: the check below and the load use the same resolution; the reader
        # options are the ones given for the root (keyword or URI query), without
        # resolving the root's backend
        opts = {**reader_option_values(self._config.root_uri, self._config.given), **options}
        resolved = resolve(path, role="reader", **opts)
        # on node-local disks each host holds its own ranks' files (and other hosts'
        # replicas): the commit record to every host, then which host holds what
        spread_commit(path, self._collectives)
        holders = step_holders(path, self._collectives)
        if holders is None:
            return False
        extra: dict[str, Any] = ({} if self._config.extension_registry is None
                                 else {"_extension_registry": self._config.extension_registry})
        if holders:  # a rank's reads of a file its host lacks come from one that has it
            extra["_file_holders"] = holders
        try:
            load(state, resolved, process_group=self._collectives.group, **extra)
        except DcpstoreError as exc:
            logger.warning("loading step %d from the local tier %s failed (%s); reading it "
                           "from %s", step, path, exc, self._config.root_uri)
            raise
        return True

    def _load_remote(self, state: dict[str, Any], step: int, started: float,
                     options: dict[str, Any]) -> int:
        resolved = self._root.resolved
        given = {**resolved.backend_kwargs, **resolved.reader_options}
        if self._config.extension_registry is not None:
            given["_extension_registry"] = self._config.extension_registry
        load(state, self._config.step_uri(step), process_group=self._collectives.group,
             backend=self._config.backend_name, **{**given, **options})
        return self._loaded(step, "remote", started)

    def _loaded(self, step: int, where: str, started: float) -> int:
        uri = (self._config.local_step_path(step) if where == "local"
               else self._config.step_uri(step))
        self.last_load = {"step": int(step), "where": where, "uri": uri,
                          "seconds": time.perf_counter() - started}
        if where == "local":
            logger.info("loaded step %d from the local tier %s", step, uri)
        return int(step)


def _fill(future: Future[Any], fn: Callable[[], Any]) -> None:
    try:
        future.set_result(fn())
    except BaseException as exc:
        future.set_exception(exc)
