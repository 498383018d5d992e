"""Damaged checkpoints fail loudly, naming what is damaged; they never load wrong tensors.

Every object of a committed checkpoint (the data file, the integrity manifest
``.dcpstore-<save>.json`` and ``.metadata``) is damaged in turn on every store of the
matrix (local disk, moto, SeaweedFS, fake-gcs-server, MSC over moto, Azurite): a bit
flipped at seeded random positions, the object truncated at a seeded length, or the object
deleted. What this file proves:

- ``dcpstore.load`` and ``dcp.load`` with a dcpstore reader raise, with an error that
  names the damaged object and, for a data file, the item (fqn) the damage lies in; the
  only loads that succeed are flips in manifest fields that protect nothing (its
  ``created`` time, versions, ...), and those are bit-exact;
- when ``.metadata`` or the manifest is damaged, the destination state is untouched
  (nothing is read before they are checked); damage in a data file is found while
  items are delivered, so the load raises and earlier items may already be written;
- ``dcpstore.tools.ops.verify_checkpoint`` reports or raises for every such damage, naming
  the object (and the item), and ``dcpstore verify`` exits non-zero saying so;
- a flip inside the ``torch.save`` zip headers of an item and one inside its tensor
  payload are both caught by the manifest's CRC32C, for a small (staged) tensor and a
  large one (read straight into the destination); with ``verify=False`` a payload flip
  is *not* caught by anything else, which is why verification is on by default.

The tallies (faults injected, detected by load, verify, CLI) are printed at the end of
the module (``pytest -s``). Quick: a few seeded positions per object; ``--full``: many.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from stores import Store
from torch.distributed.checkpoint.api import CheckpointException

import dcpstore
from dcpstore.dcp.safe_pickle import safe_loads
from dcpstore.storage.backend import Backend
from dcpstore.testing import assert_state_equal, many_dtypes_state
from dcpstore.tools import cli
from dcpstore.tools.ops import verify_checkpoint

logger = logging.getLogger(__name__)

KINDS = ("data", "manifest", "metadata")
#: Seeded positions per object: quick run / --full.
QUICK_FLIPS, FULL_FLIPS = 4, 40

#: What the module saw, printed at its end.
TALLY: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_tally() -> Iterator[None]:
    yield
    if TALLY:
        print("\n[corruption] " + ", ".join(f"{k}={v}" for k, v in sorted(TALLY.items())))


# -- checkpoints -----------------------------------------------------------------------


def _state(seed: int = 0) -> dict[str, Any]:
    """Every dtype plus objects, and one tensor large enough to be read straight into
    its destination. No empty tensor: a load reads every byte of the data file."""
    state = many_dtypes_state(seed)
    del state["empty"]
    state["big"] = torch.randn(64, 64, generator=torch.Generator().manual_seed(seed))
    return state


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    """A destination for ``state``: zeroed tensors, ``None`` for objects."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v.contiguous())
        elif isinstance(v, dict):
            out[k] = _blank(v)
        else:
            out[k] = None
    return out


def _untouched(dest: dict[str, Any]) -> bool:
    for v in dest.values():
        if isinstance(v, torch.Tensor):
            if v.numel() and bool(v.ne(torch.zeros_like(v)).any()):
                return False
        elif isinstance(v, dict):
            if not _untouched(v):
                return False
        elif v is not None:
            return False
    return True


@dataclasses.dataclass
class Saved:
    """A committed checkpoint and the names of its objects."""

    uri: str
    state: dict[str, Any]
    data: str
    manifest: str
    items: list[tuple[int, int, str]]  # (offset, length, fqn) in the data file

    def key(self, kind: str) -> str:
        return {"data": self.data, "manifest": self.manifest, "metadata": ".metadata"}[kind]

    def item_at(self, position: int) -> str:
        return next(fqn for off, n, fqn in self.items if off <= position < off + n)


def _save(store: Store, tag: str) -> Saved:
    state = _state()
    uri = store.uri(tag)
    dcpstore.save(state, uri, **store.options)
    backend = store.backend(uri)
    try:
        keys = [o.key for o in backend.list()]
        md = safe_loads(backend.get(".metadata"))
    finally:
        backend.close()
    (data,) = [k for k in keys if k.endswith(".distcp")]
    (manifest,) = [k for k in keys if k.startswith(".dcpstore-")]
    items = sorted((i.offset, i.length, idx.fqn) for idx, i in md.storage_data.items())
    return Saved(uri, state, data, manifest, items)


def _flip(data: bytes, position: int, bit: int) -> bytes:
    out = bytearray(data)
    out[position] ^= 1 << bit
    return bytes(out)


def _error_text(exc: BaseException) -> str:
    """Everything a user sees of an error: message, notes, chain, DCP's rank failures."""
    text = "".join(traceback.format_exception(exc))
    for failure in getattr(exc, "failures", {}).values():
        err = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(err, BaseException):
            text += "".join(traceback.format_exception(err))
    return text


# -- one damaged checkpoint, every way of reading it -------------------------------------


@dataclasses.dataclass
class Outcome:
    """What the readers made of one damaged checkpoint."""

    load_error: BaseException | None
    dest_untouched: bool
    loaded_exact: bool
    dcp_error: BaseException | None
    verify_errors: list[str]
    verify_raised: BaseException | None
    #: What the reader logged at ERROR during the plain dcp.load: the only place a
    #: torch that swallows the reader's error (2.10) leaves its cause.
    dcp_log: str = ""


def _check(store: Store, saved: Saved) -> Outcome:
    """Load with ``dcpstore.load`` and ``dcp.load``, then verify (ops)."""
    dest = _blank(saved.state)
    load_error: BaseException | None = None
    try:
        dcpstore.load(dest, saved.uri, **store.options)
    except Exception as exc:
        load_error = exc
    untouched = _untouched(dest)
    exact = False
    if load_error is None:
        assert_state_equal(dest, saved.state)  # never wrong tensors
        exact = True

    dcp_error: BaseException | None = None
    other = _blank(saved.state)
    log = _ErrorLog()
    reader_logger = logging.getLogger("dcpstore.dcp.reader")
    reader_logger.addHandler(log)
    try:
        dcp.load(other, storage_reader=dcpstore.get_reader(saved.uri, **store.options),
                 no_dist=True)
    except (Exception, CheckpointException) as exc:  # a BaseException
        dcp_error = exc
    finally:
        reader_logger.removeHandler(log)
    if dcp_error is None:
        assert_state_equal(other, saved.state)

    verify_errors: list[str] = []
    verify_raised: BaseException | None = None
    try:
        verify_errors = verify_checkpoint(saved.uri, **store.options).errors
    except Exception as exc:
        verify_raised = exc
    return Outcome(load_error, untouched, exact, dcp_error, verify_errors, verify_raised,
                   "\n".join(log.lines))


class _ErrorLog(logging.Handler):
    """Records the messages logged at ERROR and above."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _cli_verify(store: Store, uri: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``dcpstore verify URI`` in-process: its exit code and everything it printed."""
    capsys.readouterr()
    # cli.main calls logging.basicConfig: with a handler on the root logger it adds none
    # (one bound to this test's captured stderr would outlive the test)
    guard = logging.NullHandler()
    logging.getLogger().addHandler(guard)
    try:
        code = cli.main(["verify", uri, "-q", *store.cli_options()])
    finally:
        logging.getLogger().removeHandler(guard)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _names_ok(text: str, names: list[str], any_of: list[str]) -> bool:
    return all(n in text for n in names) and (not any_of or any(n in text for n in any_of))


def _assert_detected(outcome: Outcome, names: list[str], *, where: str,
                     any_of: list[str] | None = None, verify_must_fail: bool = True) -> None:
    """Load, dcp.load and verify all failed, each naming every string in ``names`` and
    at least one of ``any_of``."""
    alternatives = any_of or []
    assert outcome.load_error is not None, f"{where}: dcpstore.load did not fail"
    text = _error_text(outcome.load_error)
    assert isinstance(outcome.load_error, (dcpstore.DcpstoreError, OSError)), text
    assert _names_ok(str(outcome.load_error), names, alternatives), f"{where}: {text}"
    assert outcome.dcp_error is not None, f"{where}: dcp.load did not fail"
    dcp_text = _error_text(outcome.dcp_error)
    # torch keeps the reader's error in its own (2.13+), or swallows it (2.10: "metadata
    # is None" alone): then the reader's ERROR log is where the user reads the cause
    assert (_names_ok(dcp_text, names, alternatives)
            or _names_ok(outcome.dcp_log, names, alternatives)), (
        f"{where}: dcp.load said {dcp_text}\nand the reader logged {outcome.dcp_log!r}")
    TALLY["detected_by_load"] += 1
    if not verify_must_fail and outcome.verify_raised is None and not outcome.verify_errors:
        TALLY["detected_by_load_only"] += 1
        return
    if outcome.verify_raised is not None:
        verify_text = str(outcome.verify_raised)
    else:
        assert outcome.verify_errors, f"{where}: verify found nothing"
        verify_text = "\n".join(outcome.verify_errors)
    assert _names_ok(verify_text, names, alternatives), f"{where}: verify said {verify_text}"
    TALLY["detected_by_verify"] += 1


def _seed(store: Store, kind: str) -> int:
    """A seed per (store, kind), stable across runs."""
    return sum(map(ord, store.name + kind))


def _flip_positions(saved: Saved, backend: Backend, kind: str, count: int,
                    seed: int) -> list[tuple[int, int]]:
    size = backend.stat(saved.key(kind)).size
    rng = random.Random(f"{seed}-{kind}")
    return [(rng.randrange(size), rng.randrange(8)) for _ in range(count)]


# -- the tests -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_flipped_bit(store: Store, kind: str, full_run: bool,
                     capsys: pytest.CaptureFixture[str]) -> None:
    """A bit flipped at seeded positions of each object: detected, or (manifest fields
    that protect nothing) a bit-exact load."""
    saved = _save(store, f"flip-{kind}")
    backend = store.backend(saved.uri)
    key = saved.key(kind)
    original = backend.get(key)
    count = FULL_FLIPS if full_run else QUICK_FLIPS
    harmless = 0
    try:
        for n, (position, bit) in enumerate(_flip_positions(saved, backend, kind, count,
                                                            seed=_seed(store, kind))):
            backend.put(key, _flip(original, position, bit))
            TALLY["faults_injected"] += 1
            where = f"{store.name}: bit {bit} of byte {position} of {key}"
            outcome = _check(store, saved)
            if kind == "data":
                _assert_detected(outcome, [key, saved.item_at(position)], where=where)
            elif kind == "metadata":
                _assert_detected(outcome, [".metadata"], where=where)
                assert outcome.dest_untouched, where
            elif outcome.load_error is None:
                # a field no check depends on (created, versions, ...): harmless
                assert outcome.loaded_exact and outcome.dcp_error is None, where
                harmless += 1
                TALLY["harmless_manifest_flips"] += 1
            else:
                # a damaged CRC field is reported as a mismatch of the data file's item
                _assert_detected(outcome, [], any_of=[key, saved.data], where=where,
                                 verify_must_fail=False)
            if n == 0 and outcome.load_error is not None and (
                    outcome.verify_raised is not None or outcome.verify_errors):
                code, output = _cli_verify(store, saved.uri, capsys)
                assert code != 0 and (key in output or saved.data in output), (where, output)
                TALLY["detected_by_cli"] += 1
            if outcome.load_error is not None and not outcome.dest_untouched:
                TALLY["failed_loads_with_partly_written_destination"] += 1
    finally:
        backend.put(key, original)
        backend.close()
    assert harmless < count, "no flip of the manifest was detected at all"


@pytest.mark.parametrize("kind", KINDS)
def test_truncated(store: Store, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each object cut at a seeded length (and emptied): detected, naming the object and,
    for the data file, the item that was cut."""
    saved = _save(store, f"trunc-{kind}")
    backend = store.backend(saved.uri)
    key = saved.key(kind)
    original = backend.get(key)
    rng = random.Random(_seed(store, kind))
    try:
        for length in (rng.randrange(1, len(original)), 0):
            backend.put(key, original[:length])
            TALLY["faults_injected"] += 1
            where = f"{store.name}: {key} cut to {length} of {len(original)} bytes"
            outcome = _check(store, saved)
            names = [key] + ([saved.item_at(length)] if kind == "data" else [])
            _assert_detected(outcome, names, where=where)
            if kind != "data":
                assert outcome.dest_untouched, where
            code, output = _cli_verify(store, saved.uri, capsys)
            assert code != 0 and key in output, (where, code, output)
            TALLY["detected_by_cli"] += 1
    finally:
        backend.put(key, original)
        backend.close()
    out = _blank(saved.state)
    dcpstore.load(out, saved.uri, **store.options)  # restored: loads again
    assert_state_equal(out, saved.state)


@pytest.mark.parametrize("kind", KINDS)
def test_deleted(store: Store, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each object deleted: detected, naming it (and, for the data file, its items)."""
    saved = _save(store, f"del-{kind}")
    backend = store.backend(saved.uri)
    key = saved.key(kind)
    try:
        backend.delete([key])
        TALLY["faults_injected"] += 1
        outcome = _check(store, saved)
        where = f"{store.name}: {key} deleted"
        names = [key] + ([saved.items[0][2]] if kind == "data" else [])
        if kind == "metadata":
            # no commit point: an incomplete checkpoint, and verify finds no checkpoint
            assert isinstance(outcome.load_error, dcpstore.IncompleteCheckpointError), where
            assert isinstance(outcome.verify_raised, dcpstore.CheckpointNotFoundError), where
            assert ".metadata" in str(outcome.load_error)
            assert ".metadata" in str(outcome.verify_raised)
            assert outcome.dcp_error is not None
            TALLY["detected_by_load"] += 1
            TALLY["detected_by_verify"] += 1
        else:
            _assert_detected(outcome, names, where=where)
        if kind != "data":
            assert outcome.dest_untouched, where
        code, output = _cli_verify(store, saved.uri, capsys)
        assert code != 0 and key in output, (where, code, output)
        TALLY["detected_by_cli"] += 1
    finally:
        backend.close()


def _payload_position(saved: Saved, data: bytes, fqn: str) -> tuple[int, int]:
    """``(item offset, offset of the tensor's raw bytes)`` of tensor item ``fqn``."""
    offset, length, _ = next(i for i in saved.items if i[2] == fqn)
    raw = saved.state[fqn].contiguous().numpy().tobytes()
    inside = data[offset:offset + length].find(raw)
    assert inside > 0, f"payload of {fqn} not found in its item"
    return offset, offset + inside


@pytest.mark.parametrize("fqn", ["f32", "big"])
@pytest.mark.parametrize("where", ["zip_header", "payload"])
def test_zip_header_and_payload_flips(store: Store, fqn: str, where: str) -> None:
    """A flip in an item's ``torch.save`` zip header and one in its tensor payload, for a
    small tensor (staged) and a large one (read straight into the destination)."""
    saved = _save(store, f"zip-{where}-{fqn}")
    backend = store.backend(saved.uri)
    original = backend.get(saved.data)
    item_offset, payload = _payload_position(saved, original, fqn)
    # the zip local file header's signature ("PK\\3\\4") / a byte of the tensor data
    position = item_offset + 1 if where == "zip_header" else payload + 5
    try:
        backend.put(saved.data, _flip(original, position, 0))
        TALLY["faults_injected"] += 1
        outcome = _check(store, saved)
        _assert_detected(outcome, [saved.data, fqn], where=f"{store.name}: {where} of {fqn}")
        assert "CRC32C mismatch" in str(outcome.load_error)

        # without verification nothing else stands guard over the payload bytes
        unverified = _blank(saved.state)
        try:
            dcpstore.load(unverified, saved.uri, verify=False, **store.options)
        except Exception as exc:
            TALLY[f"verify_false_{where}_raised"] += 1
            logger.info("verify=False, %s flip of %s: %s", where, fqn, exc)
        else:
            differs = [k for k in ("f32", "big")
                       if not torch.equal(unverified[k], saved.state[k])]
            TALLY[f"verify_false_{where}_{'wrong' if differs else 'exact'}"] += 1
            if where == "payload":
                assert differs == [fqn], "a payload flip must show in exactly that tensor"
    finally:
        backend.put(saved.data, original)
        backend.close()


#: Address space a sweep process may grow by: a damaged ``.metadata`` can make CPython's
#: C unpickler try to allocate gigabytes (a flipped opcode that resizes its memo to a
#: huge index) before it fails; bounded, that is a MemoryError, not the OOM killer.
SWEEP_MEMORY_HEADROOM = 1 << 30


def _limit_memory() -> None:
    import resource

    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])
    limit = pages * os.sysconf("SC_PAGE_SIZE") + SWEEP_MEMORY_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _sweep(uri: str, data: str, stride: int) -> Counter[str]:
    """Flip one bit at every ``stride``-th byte of ``.metadata`` and of the manifest and
    load (and, for ``.metadata``, verify) each time; runs in a child process with bounded
    memory."""
    logging.disable(logging.CRITICAL)  # DCP logs every failed load with its traceback
    state = _state()
    tally: Counter[str] = Counter()
    manifest = next(p.name for p in Path(uri).glob(".dcpstore-*.json"))
    for kind, name in (("metadata", ".metadata"), ("manifest", manifest)):
        path = Path(uri) / name
        original = path.read_bytes()
        for position in range(0, len(original), stride):
            path.write_bytes(_flip(original, position, position % 8))
            tally["faults_injected"] += 1
            dest = _blank(state)
            try:
                dcpstore.load(dest, uri)
            except (dcpstore.DcpstoreError, OSError) as exc:
                if kind == "metadata":
                    assert ".metadata" in str(exc) and _untouched(dest), (position, str(exc))
                else:  # a damaged item record reads as a mismatch of the data file
                    assert name in str(exc) or data in str(exc), (position, str(exc))
                tally["detected_by_load"] += 1
                if "MemoryError" in str(exc):
                    tally["metadata_flips_that_asked_for_gigabytes"] += 1
            else:
                assert kind == "manifest", f"flip at {position} of .metadata loaded"
                assert_state_equal(dest, state)
                tally["harmless_manifest_flips"] += 1
            if kind == "metadata":  # verify fails too, cleanly, naming the object
                try:
                    problems = "\n".join(verify_checkpoint(uri).errors)
                except (dcpstore.DcpstoreError, OSError) as exc:
                    problems = str(exc)
                assert ".metadata" in problems, (position, problems)
                tally["detected_by_verify"] += 1
        path.write_bytes(original)
    return tally


def test_every_byte_of_metadata_and_manifest_local(tmp_path: Path, full_run: bool) -> None:
    """Local, exhaustively (``--full``) or every 37th byte (quick): every flip of
    ``.metadata`` fails the load and verify; every flip of the manifest fails the load or
    is harmless.

    Runs in a child process whose address space is bounded (see
    :data:`SWEEP_MEMORY_HEADROOM`): some flips make the unpickler ask for gigabytes.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    store = Store("local", str(tmp_path), {}, {})
    saved = _save(store, "sweep")
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context, initializer=_limit_memory) as pool:
        tally = pool.submit(_sweep, saved.uri, saved.data, 1 if full_run else 37).result(
            timeout=1800)
    TALLY.update(tally)
    assert tally["detected_by_load"] > 0 and tally["faults_injected"] > 0
