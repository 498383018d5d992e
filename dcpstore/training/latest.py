"""The newest committed step of a run root, without listing every object of every step.

After a step commits at the root (its ``.metadata`` is there), the coordinator writes
a small pointer object, ``<root>/.dcpstore-latest.json`` (by compare-and-swap where the
store has conditional writes: it never moves backwards, see :func:`write_pointer`)::

    {"format": 1, "step": 1200, "dir": "step-000001200",
     "save_id": "dcpstore-…", "metadata_size": 81234}

:func:`find_latest` trusts it only after checking it and never names an uncommitted step:

1. GET the pointer; read the last bytes of the step's ``.metadata`` (one ranged GET at
   ``metadata_size``): the pointer holds only if that ``.metadata`` exists, has that size
   and names the pointer's save id. (A step deleted or overwritten since fails this.)
2. One delimiter listing of the step directories *after* the pointer's (S3
   ``StartAfter``): a newer step committed while its pointer update was lost (a crash
   between the commit and the pointer PUT, or two writers) is found here. Each newer
   directory, newest first, is checked with one HEAD of its ``.metadata``; directories
   without one (a save in flight, a crashed one) are skipped.
3. With no pointer, or one that fails step 1, the same listing runs from the start
   and the newest directory with a ``.metadata`` wins.

So a ``latest()`` costs about three requests whatever the number of ranks and steps, and
a lost or stale pointer costs one HEAD per step directory at worst.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dcpstore.dcp import layout
from dcpstore.errors import PreconditionFailedError
from dcpstore.storage.backend import Backend, ReadRange

__all__ = ["POINTER_KEY", "Pointer", "committed_steps", "confirm_committed", "find_latest",
           "read_pointer", "step_dir", "step_dirs", "write_pointer"]

logger = logging.getLogger(__name__)

#: Key of the pointer object under the run root.
POINTER_KEY = ".dcpstore-latest.json"
_FORMAT = 1
#: Bytes at the end of ``.metadata`` read to find its save id (``storage_meta`` is
#: pickled last, after the storage entries).
_TAIL = 4096
_STEP_RE = re.compile(r"^step-(\d+)$")
#: Most HEADs of step directories in flight at once (:func:`confirm_committed`).
_HEADS = 16


def step_dir(step: int) -> str:
    """Directory name of a step: ``step-000000123``."""
    return f"step-{step:09d}"


@dataclass(frozen=True)
class Pointer:
    """What the pointer object says.

    Attributes:
        step: The step it names.
        save_id: The dcpstore save id of that step's ``.metadata``.
        metadata_size: Size of that ``.metadata`` in bytes.
    """

    step: int
    save_id: str
    metadata_size: int

    def to_bytes(self) -> bytes:
        return json.dumps({"format": _FORMAT, "step": self.step, "dir": step_dir(self.step),
                           "save_id": self.save_id,
                           "metadata_size": self.metadata_size}).encode()


#: Lost compare-and-swaps of the pointer (other jobs publishing) before giving up.
_POINTER_RACES = 8


def write_pointer(root: Backend, pointer: Pointer) -> bool:
    """Point ``root``'s latest at ``pointer``; call after its step committed.

    On a store with conditional writes the pointer advances by compare-and-swap: read
    it (HEAD for its version, GET), and replace it only if it names an older step, the
    same step (overwritten since), or a step that no longer holds; the PUT's
    ``if_match`` (``if_absent`` where there is none) fails if another job moved it
    meanwhile, and the decision is made again. So two jobs publishing never move it
    backwards. Elsewhere it is one PUT (:func:`find_latest` still finds a newer step
    by listing after the pointer).

    Returns:
        Whether the pointer now names ``pointer`` (``False``: it names a newer step).
    """
    data = pointer.to_bytes()
    if not root.conditional_writes:
        root.put(POINTER_KEY, data, atomic=True)
        return True
    for _ in range(_POINTER_RACES):
        try:
            version = root.stat(POINTER_KEY).version
            current = read_pointer(root)
        except FileNotFoundError:
            version, current = None, None
        if (current is not None and current.step > pointer.step
                and pointer_holds(root, current)):
            logger.info("the latest pointer of %s names step %d, newer than %d: kept",
                        root.uri, current.step, pointer.step)
            return False
        try:
            if version is None:
                root.put(POINTER_KEY, data, atomic=True, if_absent=True)
            else:
                root.put(POINTER_KEY, data, atomic=True, if_match=version)
            return True
        except PreconditionFailedError:
            if read_pointer(root) == pointer:
                return True  # a retry of this PUT, whose first answer was lost
            logger.debug("the latest pointer of %s moved meanwhile; reading it again",
                         root.uri)
    raise PreconditionFailedError(
        f"could not move the latest pointer of {root.uri} to step {pointer.step}: other "
        f"jobs moved it {_POINTER_RACES} times meanwhile")


def read_pointer(root: Backend) -> Pointer | None:
    """The pointer under ``root`` (``None`` when there is none or it is unreadable)."""
    try:
        raw = root.get(POINTER_KEY)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        return Pointer(int(doc["step"]), str(doc["save_id"]), int(doc["metadata_size"]))
    except (ValueError, KeyError, TypeError) as exc:
        logger.warning("ignoring the unreadable latest pointer %s/%s (%s)", root.uri,
                       POINTER_KEY, exc)
        return None


def pointer_holds(root: Backend, pointer: Pointer) -> bool:
    """Whether ``pointer``'s step is committed with the save id and size it records."""
    size = pointer.metadata_size
    if size <= 0 or not pointer.save_id.startswith("dcpstore-"):
        return False
    key = f"{step_dir(pointer.step)}/{layout.METADATA_KEY}"
    start = max(0, size - _TAIL)
    try:
        # one ranged GET ending at the recorded size: a shorter object fails it
        ((_, tail),) = list(root.read_ranges([ReadRange(key, start, size - start)]))
        # the full id ("dcpstore-" + hex) is in storage_meta only; data file names in
        # the storage entries carry the bare hex
        return pointer.save_id.encode() in bytes(tail)
    except (FileNotFoundError, OSError) as exc:
        logger.debug("latest pointer of %s names step %d, which does not hold (%s)",
                     root.uri, pointer.step, exc)
        return False


def step_dirs(root: Backend, *, after: int | None = None,
              names: Iterable[str] | None = None) -> list[int]:
    """Steps that have a directory under ``root`` (committed or not), oldest first; only
    those newer than ``after`` if given. One delimiter listing, unless ``names`` (the
    directories under ``root``, listed already) are given."""
    start = step_dir(after) if after is not None else ""
    steps = []
    for name in root.list_dirs(start_after=start) if names is None else names:
        m = _STEP_RE.match(name)
        if m:
            steps.append(int(m.group(1)))
    return sorted(s for s in steps if after is None or s > after)


def is_committed(root: Backend, step: int) -> bool:
    """Whether ``step``'s ``.metadata`` exists (one HEAD)."""
    return root.exists(f"{step_dir(step)}/{layout.METADATA_KEY}")


def find_latest(root: Backend) -> int | None:
    """The newest committed step under ``root`` (see the module docstring)."""
    pointer = read_pointer(root)
    base = pointer.step if pointer is not None and pointer_holds(root, pointer) else None
    if pointer is not None and base is None:
        logger.info("the latest pointer of %s (step %d) does not hold; listing the steps",
                    root.uri, pointer.step)
    for step in reversed(step_dirs(root, after=base)):
        if is_committed(root, step):
            if base is not None:
                logger.info("step %d under %s is committed but newer than the latest "
                            "pointer (step %d)", step, root.uri, base)
            return step
    return base


def committed_steps(root: Backend, known: Iterable[int] = (),
                    names: Iterable[str] | None = None) -> list[int]:
    """Steps under ``root`` that have a ``.metadata``, oldest first: one delimiter
    listing of the step directories (or ``names``, listed already), then one HEAD per
    directory, concurrent, except for the steps in ``known``.

    Args:
        root: The run root.
        known: Steps the caller committed itself a moment ago (the save that triggered
            a retention): not checked again. Every other step is checked, those this
            process saw committed earlier too: one deleted since by someone else
            (``dcpstore rm``, another job) is not counted, though its directory may
            still be listed (a store that keeps directories, as SeaweedFS's filer; a
            deletion that stopped after ``.metadata``; files kept for other steps).
        names: The directories under ``root``, listed already.
    """
    dirs = step_dirs(root, names=names)
    return [s for s, ok in zip(dirs, confirm_committed(root, dirs, known), strict=True) if ok]


def confirm_committed(root: Backend, steps: list[int], trusted: Iterable[int] = ()
                      ) -> list[bool]:
    """Whether each of ``steps`` is committed under ``root`` (one HEAD of its
    ``.metadata`` each, up to :data:`_HEADS` at once; the steps in ``trusted`` without
    one), in the order given."""
    trusted = set(trusted)
    ask = [s for s in steps if s not in trusted]
    if len(ask) <= 1:
        found = {s: is_committed(root, s) for s in ask}
    else:
        with ThreadPoolExecutor(min(_HEADS, len(ask)),
                                thread_name_prefix="dcpstore-head") as pool:
            found = dict(zip(ask, pool.map(lambda s: is_committed(root, s), ask),
                             strict=True))
    return [s in trusted or found[s] for s in steps]
