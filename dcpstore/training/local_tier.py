"""The local tier of a :class:`~dcpstore.Checkpointer`: commit to a local directory first,
drain to the root URI in the background.

A step in the local tier is an ordinary dcpstore checkpoint (same commit protocol, same
manifest). The drain copies it to the remote the way ``dcpstore cp`` does: data files
first, each rank its own (``__<rank>_*``, so node-local directories work), checked against
the manifest's CRC32C where the rank can read it; then the coordinator writes the manifest
and ``.metadata`` last. An interrupted drain leaves no committed step on the remote, only
files that ``dcpstore gc`` removes.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dcpstore.dcp import layout
from dcpstore.dcp.checksum import crc32c
from dcpstore.dcp.manifest import Manifest
from dcpstore.dcp.metadata_io import load_metadata, read_manifest
from dcpstore.errors import DcpstoreError, PreconditionFailedError
from dcpstore.storage.backend import Backend
from dcpstore.storage.multipart import anonymous_buffer

__all__ = [
    "DrainError",
    "LocalTierUnavailable",
    "Step",
    "copy_rank_files",
    "local_committed_steps",
    "local_record",
    "local_step_verified",
    "probe_local_tier",
    "publish_step",
    "rank_files",
]

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d+)$")
_RANK_FILE_RE = re.compile(r"^__(\d+)_")
_CHUNK = 8 << 20


class DrainError(DcpstoreError):
    """Copying a locally committed step to the remote failed after every retry.

    The step stays committed in the local tier (it loads from there on this node); the
    remote holds the previous steps, intact, and no torn copy of this one.
    """


class LocalTierUnavailable(DcpstoreError):
    """The local tier cannot take this save (unwritable or not enough free space)."""


class Step(int):
    """A committed step number that also tells where it is committed.

    Compares and hashes as the plain ``int``.

    Attributes:
        local: Committed in the local tier (as the rank that listed it sees it there;
            :meth:`~dcpstore.Checkpointer.load` loads locally only when every rank holds
            the step).
        remote: Committed at the root URI.
    """

    local: bool
    remote: bool

    def __new__(cls, value: int, *, local: bool = False, remote: bool = True) -> Step:
        obj = super().__new__(cls, value)
        obj.local = local
        obj.remote = remote
        return obj

    def __reduce__(self) -> tuple[object, ...]:
        return (_make_step, (int(self), self.local, self.remote))

    def __repr__(self) -> str:
        return f"Step({int(self)}, where={self.where!r})"

    def __str__(self) -> str:  # f"{step}" and str(step) read as the plain number
        return int.__repr__(self)

    def __format__(self, spec: str) -> str:
        return format(int(self), spec)

    @property
    def where(self) -> str:
        """``"local"``, ``"remote"`` or ``"both"``."""
        if self.local and self.remote:
            return "both"
        return "local" if self.local else "remote"


def _make_step(value: int, local: bool, remote: bool) -> Step:
    return Step(value, local=local, remote=remote)


def local_committed_steps(directory: str) -> list[int]:
    """Steps under ``directory`` with a ``.metadata`` (no verification)."""
    try:
        names = os.listdir(directory)
    except OSError:  # missing or unusable: it holds nothing
        return []
    out = []
    for name in names:
        m = _STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(directory, name, layout.METADATA_KEY)):
            out.append(int(m.group(1)))
    return sorted(out)


def local_step_verified(backend: Backend) -> bool:
    """Whether the step at ``backend`` (local) is committed and whole: ``.metadata``
    parses, matches its manifest, and every file the manifest lists is there with its size.
    CRC32Cs are checked by the load itself."""
    try:
        md, raw = load_metadata(backend)
        save_id = layout.save_id_of_metadata(md, source=f"{backend.uri}/.metadata")
        manifest = read_manifest(backend, save_id, required=True)
        if manifest is None:
            return False
        manifest.check_metadata(raw, source=f"{backend.uri}/.metadata")
        return all(backend.stat(path).size == rec.size for path, rec in manifest.files.items())
    except Exception as exc:
        logger.info("local copy at %s is not usable (%s); reading the remote", backend.uri, exc)
        return False


def local_record(local_step: str) -> Manifest | None:
    """The manifest of the save committed at ``local_step``, checked against its
    ``.metadata``; ``None`` (logged) where there is no such record or it does not match."""
    try:
        return _local_manifest(local_step)
    except Exception as exc:
        logger.info("local copy at %s has no usable commit record (%s)", local_step, exc)
        return None


def probe_local_tier(directory: str, need_bytes: int) -> str | None:
    """Why the local tier cannot take ``need_bytes`` more, or ``None`` when it can."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".dcpstore-probe-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"x")
        os.unlink(probe)
    except OSError as exc:
        return f"{directory} is not writable ({exc.strerror or exc})"
    free = shutil.disk_usage(directory).free
    if free < need_bytes:
        return (f"{directory} has {free / 1e9:.2f} GB free, this rank needs "
                f"{need_bytes / 1e9:.2f} GB")
    return None


def is_space_or_permission_error(exc: BaseException) -> bool:
    """Whether ``exc`` means the local disk cannot take the save (full, read-only, ...)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (
                errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                errno.ENOTDIR):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


@dataclass
class _Copied:
    files: int = 0
    bytes: int = 0


def _mine(name: str, rank: int, coordinator: bool) -> bool:
    if name == layout.METADATA_KEY or layout.save_id_of(name) is None:
        return False  # .metadata, temp files, probes
    m = _RANK_FILE_RE.match(name)
    if m is None:
        return False  # the manifest: published with .metadata
    return int(m.group(1)) == rank


def rank_files(local_step: str, rank: int) -> list[tuple[str, int]]:
    """The data files rank ``rank`` wrote into the local step, with their sizes, by name."""
    try:
        names = sorted(os.listdir(local_step))
    except OSError:
        return []
    return [(n, os.path.getsize(os.path.join(local_step, n)))
            for n in names if _mine(n, rank, False)]


def copy_rank_files(local_step: str, remote: Backend, rank: int, coordinator: bool,
                    *, concurrency: int = 4) -> _Copied:
    """Copy this rank's data files of the step at ``local_step`` to ``remote`` (the step's
    remote location), checked against the manifest when this rank can read it.

    Up to ``concurrency`` files are copied at once (each upload is itself concurrent
    where the backend's is, e.g. S3 multipart parts)."""
    manifest = _local_manifest(local_step)
    names = [n for n in sorted(os.listdir(local_step)) if _mine(n, rank, coordinator)]
    done = _Copied()
    if len(names) <= 1 or concurrency <= 1:
        sizes = [_copy_file(local_step, name, remote, manifest) for name in names]
    else:
        with ThreadPoolExecutor(min(concurrency, len(names)),
                                thread_name_prefix="dcpstore-drain") as pool:
            futures = [pool.submit(_copy_file, local_step, n, remote, manifest) for n in names]
            errors: list[BaseException] = []
            sizes = []
            for future in futures:
                try:
                    sizes.append(future.result())
                except BaseException as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]
    done.files = len(sizes)
    done.bytes = sum(sizes)
    return done


def _copy_file(local_step: str, name: str, remote: Backend, manifest: Manifest | None) -> int:
    rec = manifest.files.get(name) if manifest else None
    crc = 0
    size = 0
    # one chunk buffer per file, read into: an 8 MiB ``bytes`` per read would come from
    # the copying thread's malloc arena, and freed arena memory stays resident (RSS
    # grew with every drain); anonymous memory goes back to the OS when dropped
    buf = anonymous_buffer(_CHUNK)
    view = memoryview(buf)
    try:
        with open(os.path.join(local_step, name), "rb", buffering=0) as src, \
                remote.open_upload(name) as up:
            while True:
                n = src.readinto(view)
                if not n:
                    break
                chunk = view[:n]
                up.write(chunk)
                crc = crc32c(chunk, crc)
                size += n
                chunk.release()
            if rec is not None and (rec.size != size or rec.crc32c != crc):
                raise DrainError(f"{local_step}/{name}: size/CRC32C differ from the "
                                 "manifest; the local copy is damaged, the remote is left "
                                 "as it was")
            info = up.commit()
    finally:
        view.release()
        buf.close()
    if info.size != size:
        raise DrainError(f"{remote.uri}/{name}: stored {info.size} bytes of {size}")
    return size


def _local_manifest(local_step: str) -> Manifest | None:
    try:
        with open(os.path.join(local_step, layout.METADATA_KEY), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None  # node-local directory without the coordinator's files
    from dcpstore.dcp.safe_pickle import safe_loads

    md = safe_loads(raw, source=f"{local_step}/.metadata")
    save_id = layout.save_id_of_metadata(md, source=f"{local_step}/.metadata")
    path = os.path.join(local_step, layout.manifest_key(str(save_id)))
    with open(path, "rb") as f:
        manifest = Manifest.from_bytes(f.read(), source=path)
    manifest.check_metadata(raw, source=f"{local_step}/.metadata")
    return manifest


def publish_step(local_step: str, remote: Backend, *, overwrite: bool = False) -> None:
    """Coordinator: after every rank copied its files, write the manifest and then
    ``.metadata`` (the commit point) to ``remote``.

    Raises:
        DrainError: A file the manifest lists is missing or has the wrong size on the
            remote, or the remote already holds another committed save of this step.
    """
    with open(os.path.join(local_step, layout.METADATA_KEY), "rb") as f:
        raw = f.read()
    manifest = _local_manifest(local_step)
    if manifest is None:
        raise DrainError(f"{local_step}: no .metadata in the local tier")
    sizes = {o.key: o.size for o in remote.list("__")}
    for path, rec in manifest.files.items():
        if sizes.get(path) != rec.size:
            raise DrainError(f"{remote.uri}/{path}: missing or incomplete after the copy; "
                             "not committing")
    try:
        existing = remote.get(layout.METADATA_KEY)
    except FileNotFoundError:
        existing = None
    if existing == raw:
        return  # committed by an earlier attempt whose answer was lost
    if existing is not None and not overwrite:
        raise DrainError(f"{remote.uri} already holds another committed checkpoint of this "
                         "step; pass overwrite=True to the Checkpointer to replace it")
    mkey = layout.manifest_key(manifest.save_id)
    with open(os.path.join(local_step, mkey), "rb") as f:
        remote.put(mkey, f.read())
    if overwrite or not remote.conditional_writes:
        remote.put(layout.METADATA_KEY, raw, atomic=True)
        return
    try:  # two jobs draining one step: one commits
        remote.put(layout.METADATA_KEY, raw, atomic=True, if_absent=True)
    except PreconditionFailedError:
        try:
            if remote.get(layout.METADATA_KEY) == raw:
                return  # this drain's own PUT, retried after its answer was lost
        except FileNotFoundError:
            pass
        raise DrainError(f"{remote.uri}: another job committed this step while this drain "
                         "ran; pass overwrite=True to the Checkpointer to replace it") from None
