"""Where logical keys live in the bucket: the root prefix and the prefix strategy.

Prefix strategy ``hash``: S3 scales request rates per key prefix. With
``prefix_strategy="hash"`` the data files (``__*.distcp``) of a checkpoint are stored
under ``<root>/<hh>/<name>``, ``hh`` being two hex digits of a hash of the file name,
so the ranks' parallel uploads and reads spread over 256 prefixes. The mapping is done
inside every primitive, so the *logical* key space (what ``.metadata`` and the manifest
record, what ``list`` returns) is unchanged and the checkpoint loads by its root URI.
Reads of a data file fall back to the other layout when the object is missing, so a
checkpoint loads whichever strategy wrote it (torch's own ``FsspecReader`` does not know
the mapping: keep the default ``"none"`` for checkpoints it must read).
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["KeyLayout", "hashed_key", "is_data_file", "logical_key"]

_DATA_FILE = re.compile(r"^__[^/]*\.distcp$")
_HASHED_DATA_FILE = re.compile(
    r"^(?P<dir>(?:.*/)?)(?P<hash>[0-9a-f]{2})/(?P<name>__[^/]*\.distcp)$"
)


def _name_hash(name: str) -> str:
    """Two hex digits spreading data files over 256 prefixes (stable across processes)."""
    return hashlib.sha256(name.encode()).hexdigest()[:2]


def hashed_key(key: str) -> str:
    """The physical key of a data file under the ``hash`` prefix strategy."""
    head, _, name = key.rpartition("/")
    return f"{head}/{_name_hash(name)}/{name}" if head else f"{_name_hash(name)}/{name}"


def logical_key(physical: str) -> str:
    """Undo :func:`hashed_key` (keys that are not hashed data files are unchanged)."""
    m = _HASHED_DATA_FILE.match(physical)
    if m is not None and _name_hash(m.group("name")) == m.group("hash"):
        return m.group("dir") + m.group("name")
    return physical


def is_data_file(key: str) -> bool:
    """Whether ``key`` names a DCP data file (``__*.distcp``)."""
    return bool(_DATA_FILE.match(key.rpartition("/")[2]))


class KeyLayout:
    """Logical keys (relative to the checkpoint root) to S3 keys and back.

    Args:
        root: Key prefix of the checkpoint root (``""`` or ending in ``/``).
        strategy: ``"none"`` or ``"hash"`` (see the module docstring).
    """

    def __init__(self, root: str, strategy: str) -> None:
        self.root = root
        self.hashed = strategy == "hash"

    def physical(self, key: str) -> str:
        """The S3 key storing logical ``key``."""
        if self.hashed and is_data_file(key):
            return self.root + hashed_key(key)
        return self.root + key

    def alternative(self, key: str) -> str | None:
        """Where a data file lives under the *other* strategy (read fallback); ``None``
        for keys that are not data files."""
        if not is_data_file(key):
            return None
        return self.root + key if self.hashed else self.root + hashed_key(key)

    def logical(self, physical: str) -> str:
        """The logical key of an S3 key under the root."""
        return logical_key(physical[len(self.root):])

    def list_prefix(self, prefix: str) -> str:
        """The S3 prefix to list for logical ``prefix``: its directory when hashed data
        files could match it, else the prefix itself."""
        if self.hashed:
            head, _, tail = prefix.rpartition("/")
            if tail.startswith("__") or "__".startswith(tail):
                return self.root + (head + "/" if head else "")
        return self.root + prefix
