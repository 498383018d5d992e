"""``python -m benchmarks.scale``: dcpstore's coordinator at 64 to 1,024 ranks, no processes.

The model drives dcpstore's own coordinator code directly with synthetic plans of an
FSDP2 + TP model (a Llama-like stack on a 2-D ``dp x tp`` mesh: sharded weights and
their optimizer state, replicated norms and biases, a plain ``step`` per parameter,
a few byte items), over an in-memory store that counts requests the way S3 bills
them (a LIST request returns at most 1,000 keys). What it measures per world size:

- ``prepare_local_plan`` on one rank and the bytes dcpstore adds to the plan gather;
- ``prepare_global_plan`` (the sharding guard included, and the guard alone), and a
  repeated save with the same plan (torch's ``enable_plan_caching``) where supported;
- ``finish``: building and pickling ``.metadata`` and the manifest, their sizes;
- the store requests of one save (every rank's data file and the coordinator's
  objects) and of one load's shared objects (``.metadata`` and manifest per rank);
- ``Checkpointer.latest()``, ``steps()`` and retention with 100 steps retained;
- the coordinator's peak Python memory (``tracemalloc``) in planning and commit.

Torch's own planner (``create_global_plan``, dedup) and the collectives are not part of
the model: it measures what dcpstore adds. Examples::

    python -m benchmarks.scale                         # 64, 256, 1024 ranks
    python -m benchmarks.scale --quick                 # tiny sizes, seconds (CI)
    python -m benchmarks.scale --ranks 64 256 --out benchmarks/results/scale
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import pickle
import platform
import statistics
import sys
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from .env import DirtyTree, checkout_text, git_commit, run_checkout

__all__ = ["S3_LIST_PAGE", "Mix", "main", "run_scale"]

#: Keys per LIST response on S3 (and GCS's default page): what a listing costs.
S3_LIST_PAGE = 1000
BUCKET = "scale-model"
#: Steps retained under the run root for the listing measurements.
RETAINED = 100

# S3's request verbs for each counter of MemoryBackend.
_VERBS = {
    "put": "PUT", "upload_part": "PUT", "create_upload": "POST", "complete_upload": "POST",
    "get": "GET", "range_get": "GET", "head": "HEAD", "list": "LIST", "delete": "DELETE",
    "list_uploads": "LIST", "abort_upload": "DELETE",
}
VERBS = ("PUT", "POST", "GET", "HEAD", "LIST", "DELETE")


@dataclass(frozen=True)
class Mix:
    """The synthetic model: a decoder stack on a ``dp x tp`` mesh.

    Per layer: ``wq wk wv wo w1 w2 w3`` sharded (FSDP2 on dim 0 over ``dp``, TP
    column- or row-wise over ``tp``), two norms and two biases replicated. Every
    parameter has ``exp_avg``/``exp_avg_sq`` placed like it and a plain ``step``.
    """

    layers: int = 40
    hidden: int = 4096
    kv: int = 1024
    ffn: int = 14336
    vocab: int = 128256
    tp: int = 8
    byte_items: int = 6

    def params(self) -> list[tuple[str, tuple[int, ...], str]]:
        """``(fqn, global shape, placement)``; placement ``col``, ``row`` or ``rep``."""
        h, out = self.hidden, []
        out.append(("tok_embeddings.weight", (self.vocab, h), "col"))
        for i in range(self.layers):
            p = f"layers.{i}."
            out += [
                (p + "attention.wq.weight", (h, h), "col"),
                (p + "attention.wk.weight", (self.kv, h), "col"),
                (p + "attention.wv.weight", (self.kv, h), "col"),
                (p + "attention.wo.weight", (h, h), "row"),
                (p + "attention.wo.bias", (h,), "rep"),
                (p + "feed_forward.w1.weight", (self.ffn, h), "col"),
                (p + "feed_forward.w3.weight", (self.ffn, h), "col"),
                (p + "feed_forward.w2.weight", (h, self.ffn), "row"),
                (p + "feed_forward.w2.bias", (h,), "rep"),
                (p + "attention_norm.weight", (h,), "rep"),
                (p + "ffn_norm.weight", (h,), "rep"),
            ]
        out.append(("norm.weight", (h,), "rep"))
        out.append(("output.weight", (self.vocab, h), "col"))
        return out

    def keys(self) -> int:
        """Keys of the state dict (tensors and byte items)."""
        return 4 * len(self.params()) + self.byte_items


QUICK_MIX = Mix(layers=2, hidden=64, kv=32, ffn=128, vocab=256, tp=2, byte_items=2)

_BF16 = TensorProperties(dtype=torch.bfloat16)
_FP32 = TensorProperties(dtype=torch.float32)


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """Offset and length of piece ``i`` of ``n`` split like ``torch.chunk``."""
    size = math.ceil(n / parts) if n else 0
    lo = min(n, i * size)
    return lo, max(0, min(n, lo + size) - lo)


def _shard(shape: tuple[int, ...], placement: str, dp: int, tp: int, rank: int
           ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Offsets and sizes of ``rank``'s shard (TP first, then FSDP2 on dim 0)."""
    dp_i, tp_j = divmod(rank, tp)
    rows, cols = shape
    if placement == "col":  # TP on dim 0, FSDP2 on the TP shard's dim 0
        t_lo, t_len = _chunk(rows, tp, tp_j)
        f_lo, f_len = _chunk(t_len, dp, dp_i)
        return (t_lo + f_lo, 0), (f_len, cols)
    c_lo, c_len = _chunk(cols, tp, tp_j)  # row-wise: TP on dim 1
    f_lo, f_len = _chunk(rows, dp, dp_i)
    return (f_lo, c_lo), (f_len, c_len)


def _nbytes(sizes: tuple[int, ...], props: TensorProperties) -> int:
    return math.prod(sizes) * torch._utils._element_size(props.dtype)


@dataclass
class _Key:
    fqn: str
    shape: tuple[int, ...]
    placement: str
    props: TensorProperties


def _keys(mix: Mix) -> list[_Key]:
    keys = []
    for fqn, shape, placement in mix.params():
        keys.append(_Key(f"model.{fqn}", shape, placement, _BF16))
        for state in ("exp_avg", "exp_avg_sq"):
            keys.append(_Key(f"optim.state.{fqn}.{state}", shape, placement, _FP32))
        keys.append(_Key(f"optim.state.{fqn}.step", (), "rep", _FP32))
    return keys


def _byte_fqns(mix: Mix) -> list[str]:
    return [f"optim.param_groups.0.{n}" for n in ("lr", "betas", "eps", "weight_decay",
                                                 "foreach", "fused")][: mix.byte_items]


class _World:
    """The plans and results of one save of ``mix`` by ``world`` ranks."""

    def __init__(self, mix: Mix, world: int) -> None:
        self.mix = mix
        self.world = world
        self.tp = min(mix.tp, world)
        self.dp = world // self.tp
        self.keys = _keys(mix)
        self.byte_fqns = _byte_fqns(mix)
        self.plain = [k for k in self.keys if k.placement == "rep"]
        self.sharded = [k for k in self.keys if k.placement != "rep"]

    def local_items(self, rank: int) -> list[WriteItem]:
        """Rank ``rank``'s local plan before torch's dedup (every replicated key too)."""
        items = []
        for key in self.keys:
            if key.placement == "rep":
                zero = torch.Size([0] * len(key.shape))
                size = torch.Size(key.shape)
                items.append(WriteItem(
                    index=MetadataIndex(key.fqn, zero), type=WriteItemType.TENSOR,
                    tensor_data=TensorWriteData(ChunkStorageMetadata(zero, size),
                                                key.props, size)))
            else:
                offsets, sizes = _shard(key.shape, key.placement, self.dp, self.tp, rank)
                items.append(WriteItem(
                    index=MetadataIndex(key.fqn, torch.Size(offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                        key.props, torch.Size(key.shape))))
        if rank == 0:
            items += [WriteItem(index=MetadataIndex(f), type=WriteItemType.BYTE_IO)
                      for f in self.byte_fqns]
        return items

    def owner(self, i: int) -> int:
        """The rank torch's dedup leaves replicated item ``i`` on (spread out)."""
        return i % self.world

    def metadata(self) -> Metadata:
        """The ``Metadata`` torch's planner hands ``finish``."""
        md: dict[str, Any] = {}
        for key in self.keys:
            size = torch.Size(key.shape)
            if key.placement == "rep":
                chunks = [ChunkStorageMetadata(torch.Size([0] * len(key.shape)), size)]
            else:
                chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in
                          (_shard(key.shape, key.placement, self.dp, self.tp, r)
                           for r in range(self.world))]
            md[key.fqn] = TensorStorageMetadata(key.props, size, chunks)
        for fqn in self.byte_fqns:
            md[fqn] = BytesStorageMetadata()
        mappings = {k: tuple(k.split(".")) for k in md}
        return Metadata(state_dict_metadata=md, planner_data=mappings)

    def results(self, save_id: str) -> list[list[WriteResult]]:
        """Every rank's write results (one data file per rank), as ``finish`` gets them."""
        from dcpstore.dcp import layout
        from dcpstore.dcp.manifest import FileRecord, Payload
        from dcpstore.dcp.writer import _WrittenItem

        per_rank: list[list[tuple[MetadataIndex, int, bool]]] = [[] for _ in
                                                                range(self.world)]
        for i, key in enumerate(self.plain):
            zero = torch.Size([0] * len(key.shape))
            per_rank[self.owner(i)].append((MetadataIndex(key.fqn, zero),
                                            _nbytes(key.shape, key.props), True))
        for r in range(self.world):
            for key in self.sharded:
                offsets, sizes = _shard(key.shape, key.placement, self.dp, self.tp, r)
                per_rank[r].append((MetadataIndex(key.fqn, torch.Size(offsets)),
                                    _nbytes(sizes, key.props), True))
        for fqn in self.byte_fqns:
            per_rank[0].append((MetadataIndex(fqn), 32, False))
        out = []
        for r, items in enumerate(per_rank):
            name = layout.data_file_name(r, 0, save_id)
            results, records, payloads, pos = [], [], {}, 0
            for n, (index, nbytes, tensor) in enumerate(items):
                length = nbytes + (1024 if tensor else 0)
                crc = (r * 7919 + n) & 0xFFFFFFFF
                record = _WrittenItem(name, pos, length, None, crc)
                results.append(WriteResult(index=index, size_in_bytes=length,
                                           storage_data=record))
                records.append((pos, length, crc))
                if tensor and nbytes:
                    blocks = tuple(range(max(1, math.ceil(nbytes / (1 << 20)))))
                    payloads[pos] = Payload(1024, nbytes, blocks)
                pos += length
            if results:
                results[-1].storage_data.file = FileRecord(pos, 0, records, payloads)
            out.append(results)
        return out


# -- the store -------------------------------------------------------------------------------


def _memory_backend_class() -> type[Any]:
    """MemoryBackend with LIST counted per page of 1,000 keys, as S3 bills it."""
    from dcpstore.testing import MemoryBackend

    class PagedMemoryBackend(MemoryBackend):  # type: ignore[misc, valid-type]
        name: ClassVar[str] = "scale"
        schemes: ClassVar[tuple[str, ...]] = ("scale",)
        listed: ClassVar[Counter[str]] = Counter()

        def _pages(self, n: int) -> None:
            store = self._bucket()
            with store.lock:
                # the base class counted one request; a page holds S3_LIST_PAGE keys
                store.requests["list"] += max(1, math.ceil(n / S3_LIST_PAGE)) - 1
                store.requests["list_keys"] += n

        def _list(self, prefix: str) -> Iterator[Any]:
            found = list(super()._list(prefix))
            self._pages(len(found))
            return iter(found)

        if hasattr(MemoryBackend, "_list_dirs"):
            def _list_dirs(self, prefix: str, start_after: str) -> Any:
                found = list(super()._list_dirs(prefix, start_after))
                self._pages(len(found))
                return found

    return PagedMemoryBackend


def _requests() -> Counter[str]:
    from dcpstore.testing import MemoryBackend

    return MemoryBackend.requests(BUCKET)


def _verbs(counts: Counter[str]) -> dict[str, int]:
    out = dict.fromkeys(VERBS, 0)
    for name, n in counts.items():
        if name in _VERBS:
            out[_VERBS[name]] += n
    return out


def _delta(before: Counter[str]) -> dict[str, int]:
    now = _requests()
    now.subtract(before)
    return _verbs(+now)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def _peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    gc.collect()
    tracemalloc.start()
    try:
        value = fn()
        return value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- one world size ------------------------------------------------------------------------


def _writer(uri: str, rank: int, coordinator: bool) -> Any:
    import dcpstore

    writer = dcpstore.get_writer(uri)
    writer.set_up_storage_writer(coordinator, rank=rank)
    return writer


def _plan_cache_hit(uri: str, plans: list[SavePlan]) -> float | None:
    """Seconds of ``prepare_global_plan`` on a repeated save whose every local plan is
    unchanged (torch's plan cache sends ``SavePlan([], usable=False)``), after a save
    that filled the cache; ``None`` where the writer does not support plan caching."""
    from dcpstore.dcp import writer as writer_module

    if not getattr(writer_module, "SUPPORTS_PLAN_CACHING", False):
        return None
    _writer(uri, 0, True).prepare_global_plan(plans)  # the save that fills the cache
    again = _writer(uri, 0, True)
    unchanged = [again.prepare_local_plan(SavePlan([], usable=False)) for _ in plans]
    _, seconds = _timed(lambda: again.prepare_global_plan(unchanged))
    return seconds


def run_world(mix: Mix, world: int, *, retained: int = RETAINED) -> dict[str, Any]:
    """Measure one world size; return a row of the table."""
    from dcpstore.dcp import layout
    from dcpstore.dcp.guard import check_global_plan
    from dcpstore.dcp.reader import Reader
    from dcpstore.testing import MemoryBackend
    from dcpstore.training.checkpointer import Checkpointer, step_dir

    model = _World(mix, world)
    run = f"scale://{BUCKET}/w{world}"
    row: dict[str, Any] = {"ranks": world, "keys": mix.keys(),
                           "items_per_rank": len(model.local_items(1 % world))}

    # -- planning: every rank's prepare_local_plan, the coordinator's global plan
    plans: list[SavePlan] = []
    local_times: list[float] = []
    gather_bytes = 0
    for rank in range(world):
        writer = _writer(f"{run}/{step_dir(1)}", rank, rank == 0)
        plan = SavePlan(model.local_items(rank))
        local, seconds = _timed(lambda w=writer, p=plan: w.prepare_local_plan(p))
        local_times.append(seconds)
        gather_bytes += len(pickle.dumps(local.storage_data))
        plans.append(SavePlan([], storage_data=local.storage_data))  # items: torch's part
    row["local_plan_s"] = statistics.median(local_times)
    row["gather_bytes"] = gather_bytes
    summaries = {i: p.storage_data for i, p in enumerate(plans)}
    _, row["guard_s"] = _timed(lambda: check_global_plan(summaries))
    coord = _writer(f"{run}/{step_dir(1)}", 0, True)
    before = _requests()
    global_plans, row["global_plan_s"] = _timed(lambda: coord.prepare_global_plan(plans))
    plan_requests = _delta(before)
    row["scatter_bytes"] = sum(len(pickle.dumps(p.storage_data)) for p in global_plans)
    _, row["global_plan_peak_mb"] = _peak(
        lambda: _writer(f"{run}/{step_dir(1)}", 0, True).prepare_global_plan(plans))
    row["global_plan_peak_mb"] /= 1e6
    row["cached_plan_s"] = _plan_cache_hit(f"{run}/{step_dir(1)}", plans)
    plans, summaries = [], {}

    # -- every rank's data file (one part each: parts grow only with the data)
    save_id = global_plans[0].storage_data.save_id
    global_plans = []
    backend = MemoryBackend(f"{BUCKET}/w{world}/{step_dir(1)}")
    before = _requests()
    for rank in range(world):
        upload = backend.open_upload(layout.data_file_name(rank, 0, save_id))
        upload.write(b"\0" * 16)
        upload.commit()
    data_requests = _delta(before)

    # -- commit: .metadata and manifest
    metadata = model.metadata()
    results = model.results(save_id)
    row["pickle_metadata_s"] = _timed(lambda: pickle.dumps(metadata))[1]
    before_finish = _requests()
    _, row["finish_s"] = _timed(lambda: coord.finish(metadata, results))
    finish_requests = _delta(before_finish)
    row["metadata_mb"] = backend.stat(layout.METADATA_KEY).size / 1e6
    row["manifest_mb"] = backend.stat(layout.manifest_key(save_id)).size / 1e6
    peak_writer = _writer(f"{run}/{step_dir(2)}", 0, True)
    peak_writer.save_id = save_id
    _, peak = _peak(lambda: peak_writer.finish(model.metadata(), results))
    row["finish_peak_mb"] = peak / 1e6
    metadata, results = Metadata({}), []

    # -- the run root: `retained` committed steps of `world` data files each
    store = MemoryBackend._buckets[BUCKET]
    step_objects = {k.removeprefix(f"w{world}/{step_dir(1)}/"): v
                    for k, v in store.objects.items() if k.startswith(f"w{world}/{step_dir(1)}/")}
    for n in range(2, retained + 1):
        for key, value in step_objects.items():
            store.objects[f"w{world}/{step_dir(n)}/{key}"] = value
    ckpt = Checkpointer(run, keep_last=retained)
    publish = getattr(ckpt, "_publish_latest", None)
    if publish is not None:  # what the save of the newest step left behind
        publish(retained, save_id)
    for name, call in (("latest", ckpt.latest), ("steps", ckpt.steps),
                       ("retention", lambda: ckpt._retain(retained))):
        before = _requests()
        value, seconds = _timed(call)
        row[f"{name}_s"] = seconds
        row[f"{name}_requests"] = _delta(before)
        if name == "latest":
            assert int(value) == retained, (value, retained)
        if name == "steps":
            assert [int(s) for s in value] == list(range(1, retained + 1))
    row["listed_keys_per_latest"] = None
    before = _requests()
    ckpt.latest()
    row["listed_keys_per_latest"] = (_requests() - before)["list_keys"]
    ckpt.close()

    # -- a save's requests: planning, every rank's data, the commit, retention
    save = Counter(plan_requests)
    save.update(data_requests)
    save.update(finish_requests)
    save.update(row["retention_requests"])
    if publish is not None:
        save.update({"PUT": 1})  # the latest pointer
    row["save_requests"] = {v: save[v] for v in VERBS}

    # -- a load's shared objects: .metadata and manifest. With read sharing (the default
    # on object stores) the coordinator alone GETs them and sends the bytes to the other
    # ranks (dcpstore.dcp.read_share); without it, every rank GETs them.
    reader = Reader(MemoryBackend(f"{BUCKET}/w{world}/{step_dir(retained)}"))
    before = _requests()
    _, row["read_metadata_s"] = _timed(reader.read_metadata)
    one = _delta(before)
    shared_mb = row["metadata_mb"] + row["manifest_mb"]
    readers = 1 if reader.options.broadcast_reads is not False else world
    row["load_shared_requests_per_rank"] = one
    row["load_shared_requests"] = {v: n * readers for v, n in one.items()}
    row["load_shared_mb"] = readers * shared_mb
    row["load_shared_sent_mb"] = (world - readers) * shared_mb  # over the process group

    prefix = f"w{world}/"
    for key in [k for k in store.objects if k.startswith(prefix)]:
        del store.objects[key]
    gc.collect()
    return row


def run_scale(worlds: list[int], mix: Mix, *, retained: int = RETAINED,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the model for each world size; return the results document."""
    import dcpstore
    from dcpstore.testing import MemoryBackend

    dcpstore.register_backend("scale", _memory_backend_class(), clobber=True)
    MemoryBackend.create_bucket(BUCKET)
    rows = []
    try:
        for world in worlds:
            started = time.perf_counter()
            rows.append(run_world(mix, world, retained=retained))
            log(f"{world} ranks: {time.perf_counter() - started:.1f}s")
    finally:
        MemoryBackend.delete_bucket(BUCKET)
    return {"mix": asdict(mix), "retained": retained, "rows": rows,
            "commit": git_commit() or "unknown", "dcpstore": dcpstore.__file__,
            "python": platform.python_version(), "torch": torch.__version__}


def _fmt_requests(counts: dict[str, int]) -> str:
    return " ".join(f"{v} {counts[v]}" for v in VERBS if counts.get(v))


def _load_mb(row: dict[str, Any]) -> float:
    return float(row.get("load_shared_mb",
                         row["ranks"] * (row["metadata_mb"] + row["manifest_mb"])))


def to_markdown(doc: dict[str, Any]) -> str:
    """The results as a Markdown table (one column per world size)."""
    rows = doc["rows"]
    head = "| | " + " | ".join(f"{r['ranks']} ranks" for r in rows) + " |"
    lines = [head, "|---" * (len(rows) + 1) + "|"]

    def line(label: str, fn: Callable[[dict[str, Any]], str]) -> None:
        lines.append(f"| {label} | " + " | ".join(fn(r) for r in rows) + " |")

    def ms(key: str) -> Callable[[dict[str, Any]], str]:
        return lambda r: "n/a" if r[key] is None else f"{r[key] * 1e3:.1f}"

    line("keys / items per rank", lambda r: f"{r['keys']} / {r['items_per_rank']}")
    line("prepare_local_plan, one rank, median (ms)", ms("local_plan_s"))
    line("dcpstore's part of the plan gather (MB)", lambda r: f"{r['gather_bytes'] / 1e6:.2f}")
    line("dcpstore's part of the plan scatter (MB)",
         lambda r: f"{r['scatter_bytes'] / 1e6:.3f}")
    line("sharding guard (ms)", ms("guard_s"))
    line("prepare_global_plan (ms)", ms("global_plan_s"))
    line("prepare_global_plan, same plan again (ms)", ms("cached_plan_s"))
    line("prepare_global_plan peak (MB)", lambda r: f"{r['global_plan_peak_mb']:.1f}")
    line("finish: .metadata + manifest (ms)", ms("finish_s"))
    line("finish peak (MB)", lambda r: f"{r['finish_peak_mb']:.1f}")
    line("pickling .metadata (ms)", ms("pickle_metadata_s"))
    line(".metadata (MB)", lambda r: f"{r['metadata_mb']:.2f}")
    line("manifest (MB)", lambda r: f"{r['manifest_mb']:.2f}")
    line("requests per save", lambda r: _fmt_requests(r["save_requests"]))
    line("shared-object requests per load (all ranks)",
         lambda r: _fmt_requests(r["load_shared_requests"]))
    line(".metadata + manifest bytes read per load (MB)", lambda r: f"{_load_mb(r):,.0f}")
    line(".metadata + manifest sent to other ranks (MB)",
         lambda r: "n/a" if "load_shared_sent_mb" not in r
         else f"{r['load_shared_sent_mb']:,.0f}")
    line(f"latest() requests ({doc['retained']} steps)",
         lambda r: _fmt_requests(r["latest_requests"]))
    line("latest(): keys listed", lambda r: f"{r['listed_keys_per_latest']:,}")
    line("latest() (ms)", ms("latest_s"))
    line("steps() requests (a new process)", lambda r: _fmt_requests(r["steps_requests"]))
    line("retention after a save: requests", lambda r: _fmt_requests(r["retention_requests"]))
    return "\n".join(lines) + "\n"


def compare_markdown(before: dict[str, Any], after: dict[str, Any]) -> str:
    """One table of two runs (each world size: before, then after)."""
    tables = [to_markdown(before).splitlines(), to_markdown(after).splitlines()]
    worlds = [r["ranks"] for r in before["rows"]]
    if worlds != [r["ranks"] for r in after["rows"]]:
        raise ValueError("the two runs measured different world sizes")
    head = "| | " + " | ".join(f"{w} before | {w} after" for w in worlds) + " |"
    lines = [head, "|---" * (2 * len(worlds) + 1) + "|"]
    for old, new in zip(tables[0][2:], tables[1][2:], strict=True):
        a, b = old.strip("|").split(" | "), new.strip("|").split(" | ")
        cells = [c for pair in zip(a[1:], b[1:], strict=True) for c in pair]
        lines.append(f"|{a[0]} | " + " | ".join(c.strip() for c in cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--quick", action="store_true",
                        help="tiny model at 4 and 8 ranks, 5 steps retained (seconds; CI)")
    parser.add_argument("--layers", type=int, default=Mix.layers)
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"),
                        help="print one table of two scale.json files and exit")
    parser.add_argument("--out", type=Path, default=None,
                        help="write scale.json and scale.md into this folder")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="write results from a tree with uncommitted changes (the "
                             "results then record the diff's SHA-256)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        print(compare_markdown(before, after), end="")
        return 0
    try:
        # before anything is measured: results for the committed tree need a clean one
        checkout = run_checkout(args.out, args.allow_dirty)
    except DirtyTree as exc:
        print(f"python -m benchmarks.scale: refusing to run: {exc}", file=sys.stderr)
        return 2
    if args.quick:
        mix, worlds, retained = QUICK_MIX, [4, 8], 5
    else:
        mix, worlds, retained = Mix(layers=args.layers), args.ranks, RETAINED
    doc = run_scale(worlds, mix, retained=retained, log=lambda m: print(m, file=sys.stderr))
    doc["checkout"] = checkout
    # after the table, so that compare_markdown() still reads the table alone
    table = to_markdown(doc) + f"\nRan at {checkout_text(checkout, doc['commit'])}.\n"
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "scale.json").write_text(json.dumps(doc, indent=1) + "\n")
        (args.out / "scale.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
