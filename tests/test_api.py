"""URIs, options, registry, feature flag and bad input: specific errors, nothing lost."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import dcpstore
from dcpstore.dcp.safe_pickle import safe_loads
from dcpstore.storage import registry
from dcpstore.storage.local import LocalBackend, LocalOptions
from dcpstore.storage.options import resolve_options
from dcpstore.storage.resolve import resolve
from dcpstore.storage.uri import parse_uri, validate_key


@pytest.fixture(autouse=True)
def _clean_registry(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv("DCPSTORE_BACKEND", raising=False)
    yield
    registry._reset_for_tests()


def test_parse_uri_forms(tmp_path: Path) -> None:
    assert parse_uri(str(tmp_path)).scheme == "file"
    assert parse_uri(f"file://{tmp_path}").location == str(tmp_path)
    p = parse_uri("s3://Bucket/run7/step-1/?region=eu-west-1&part_size=8MiB")
    assert (p.scheme, p.location, p.query["region"]) == ("s3", "Bucket/run7/step-1", "eu-west-1")
    assert parse_uri("GS://b/x").scheme == "gs"


@pytest.mark.parametrize(
    "bad", ["", "   ", "s3://", "s3://b/a/../x", "s3://key:secret@b/x", "file://remotehost/x"]
)
def test_bad_uris(bad: str) -> None:
    with pytest.raises(dcpstore.InvalidURIError):
        parse_uri(bad)


def test_credentials_never_echoed_in_uri_error() -> None:
    with pytest.raises(dcpstore.InvalidURIError) as info:
        parse_uri("s3://AKIAXXXX:topsecret@bucket/x")
    assert "topsecret" not in str(info.value)


@pytest.mark.parametrize("key", ["../x", "/etc/passwd", "a/../../b", "C:/x", "a\\b", ""])
def test_unsafe_keys(key: str) -> None:
    with pytest.raises(dcpstore.UnsafeKeyError):
        validate_key(key)


def test_unknown_scheme_lists_available() -> None:
    with pytest.raises(
        dcpstore.BackendNotFoundError, match=r"unknown storage scheme 'zzz'.*file://"
    ):
        dcpstore.get_writer("zzz://bucket/x")


def test_known_scheme_without_plugin_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_entry_points", {})
    with pytest.raises(dcpstore.BackendNotFoundError, match="pip install dcpstore-s3"):
        dcpstore.get_writer("s3://bucket/x")


def test_register_backend_and_clobber(tmp_path: Path) -> None:
    class MyBackend(LocalBackend):
        name = "mine"
        schemes = ("mine",)

        @classmethod
        def from_uri(cls, uri: Any, options: Any) -> Any:
            return cls(str(tmp_path / uri.location), options)

    dcpstore.register_backend("mine", MyBackend)
    assert "mine" in dcpstore.available_backends()
    dcpstore.save({"w": torch.ones(2)}, "mine://b/x")
    assert (tmp_path / "b" / "x" / ".metadata").exists()
    with pytest.raises(ValueError, match="clobber=True"):
        dcpstore.register_backend("mine", type("Other", (LocalBackend,), {}))
    dcpstore.register_backend("mine", type("Other", (LocalBackend,), {}), clobber=True)
    with pytest.raises(TypeError):
        dcpstore.register_backend("x", object)  # type: ignore[arg-type]


def test_feature_flag_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    class Spy(LocalBackend):
        name = "spy"
        schemes = ()

        @classmethod
        def from_uri(cls, uri: Any, options: Any) -> Any:
            seen.append(uri.scheme)
            return cls(str(tmp_path / "spy"), options)

    dcpstore.register_backend("spy", Spy)
    monkeypatch.setenv("DCPSTORE_BACKEND", "spy")
    assert isinstance(dcpstore.get_writer("s3://b/x").backend, Spy)  # env beats scheme
    w = dcpstore.get_writer(str(tmp_path / "a"), backend="file")  # argument beats env
    assert type(w.backend) is LocalBackend
    assert seen == ["s3"]


def test_option_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "DCPSTORE_FILE_MAX_CONCURRENCY": "3",
        "DCPSTORE_FILE_PART_SIZE": "1MiB",
        "DCPSTORE_FILE_FSYNC": "false",
    }
    opts = resolve_options(
        LocalOptions,
        scheme="file",
        explicit={"max_concurrency": 7},
        query={"max_concurrency": "5", "part_size": "2M"},
        environ=env,
    )
    assert opts.max_concurrency == 7  # keyword > query
    assert opts.part_size == 2 * 1024 * 1024  # query > env
    assert opts.fsync is False  # env > default
    assert (
        resolve_options(LocalOptions, scheme="file", explicit={}, query={}, environ={}).fsync
        is True
    )


def test_query_and_env_options_reach_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCPSTORE_FILE_FSYNC", "0")
    w = dcpstore.get_writer(f"file://{tmp_path}/c?max_concurrency=2&files_per_rank=3")
    assert w.backend.options.max_concurrency == 2
    assert w.backend.options.fsync is False
    assert w.options.files_per_rank == 3


def test_unknown_and_invalid_options(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unknown option.*bogus.*valid options"):
        dcpstore.get_writer(tmp_path, bogus=1)
    with pytest.raises(TypeError, match="unknown URI query"):
        dcpstore.get_reader(f"file://{tmp_path}?nope=1")
    with pytest.raises(ValueError, match="not an integer"):
        dcpstore.get_writer(f"file://{tmp_path}?max_concurrency=lots")
    with pytest.raises(ValueError, match="max_concurrency must be >= 1"):
        dcpstore.get_writer(tmp_path, max_concurrency=0)


def test_path_that_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "afile"
    target.write_text("not a directory")
    with pytest.raises(NotADirectoryError, match="is a file, not a directory"):
        dcpstore.save({"w": torch.ones(1)}, target)
    assert target.read_text() == "not a directory"


def test_restricted_unpickler_refuses_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> Any:
            return (open, (str(marker), "w"))

    with pytest.raises(dcpstore.UnsafeCheckpointError, match=r"(io|builtins)\.open"):
        safe_loads(pickle.dumps(Evil()))
    assert not marker.exists()


def test_hostile_metadata_is_refused_without_running(tmp_path: Path) -> None:
    dcpstore.save({"w": torch.ones(2)}, tmp_path / "c")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> Any:
            import os

            return (os.system, (f"touch {marker}",))

    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(dcpstore.UnsafeCheckpointError, match="posix.system|os.system"):
        dcpstore.load({"w": torch.zeros(2)}, tmp_path / "c")
    assert not marker.exists()


def test_hostile_byte_item_refused_unless_allowed(tmp_path: Path) -> None:
    class Custom:
        def __init__(self) -> None:
            self.x = 1

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Custom) and other.x == self.x

    globals()["Custom"] = Custom  # picklable by reference
    Custom.__qualname__ = "Custom"
    dcpstore.save({"obj": Custom()}, tmp_path / "c")
    with pytest.raises(dcpstore.UnsafeCheckpointError, match="allow_pickle=True"):
        dcpstore.load({"obj": None}, tmp_path / "c")
    out: dict[str, Any] = {"obj": None}
    dcpstore.load(out, tmp_path / "c", allow_pickle=True)
    assert out["obj"] == Custom()


def test_traversal_in_stored_relative_path_refused(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    dcpstore.save({"w": torch.ones(2)}, tmp_path / "c")
    meta_path = tmp_path / "c" / ".metadata"
    md = safe_loads(meta_path.read_bytes())
    for k, info in md.storage_data.items():
        md.storage_data[k] = _StorageInfo("../../etc/passwd", info.offset, info.length)
    meta_path.write_bytes(pickle.dumps(md))
    with pytest.raises(dcpstore.UnsafeKeyError, match="escape"):
        dcpstore.load({"w": torch.zeros(2)}, tmp_path / "c")


def test_manifest_missing_or_damaged(tmp_path: Path) -> None:
    dcpstore.save({"w": torch.ones(2)}, tmp_path / "c")
    (manifest,) = (tmp_path / "c").glob(".dcpstore-*.json")
    manifest.write_text("{not json")
    with pytest.raises(dcpstore.IntegrityError, match="not a valid dcpstore manifest"):
        dcpstore.load({"w": torch.zeros(2)}, tmp_path / "c")
    manifest.unlink()
    with pytest.raises(dcpstore.IntegrityError, match="manifest .* is missing"):
        dcpstore.load({"w": torch.zeros(2)}, tmp_path / "c")
    out = {"w": torch.zeros(2)}
    dcpstore.load(out, tmp_path / "c", verify=False)
    assert torch.equal(out["w"], torch.ones(2))


def test_truncated_data_file(tmp_path: Path) -> None:
    dcpstore.save({"w": torch.randn(100)}, tmp_path / "c")
    (data,) = (tmp_path / "c").glob("__*.distcp")
    data.write_bytes(data.read_bytes()[:-50])
    with pytest.raises(OSError, match="truncated|ends at byte"):
        dcpstore.load({"w": torch.zeros(100)}, tmp_path / "c")


def test_failed_save_leaves_no_directory(tmp_path: Path) -> None:
    class Unpicklable:
        def __reduce__(self) -> Any:
            raise RuntimeError("nope")

    with pytest.raises(RuntimeError):
        dcpstore.save({"w": torch.ones(2), "o": Unpicklable()}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_repr_has_no_options_secrets(tmp_path: Path) -> None:
    w = dcpstore.get_writer(tmp_path / "c")
    assert repr(w) == f"Writer({str(tmp_path / 'c')!r}, overwrite=False)"
    assert "Reader(" in repr(dcpstore.get_reader(tmp_path / "c"))


def test_resolve_parses_once_and_splits_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCPSTORE_FILE_FSYNC", "0")
    monkeypatch.setenv("DCPSTORE_FILE_FILES_PER_RANK", "5")  # env is for backend options only
    resolved = resolve(f"file://{tmp_path}/c?verify=false&max_concurrency=3",
                       role="checkpointer", overwrite=True, part_size="1MiB")
    assert resolved.backend_cls is LocalBackend
    assert resolved.uri.location == str(tmp_path / "c")
    assert resolved.writer_options == {"overwrite": True}
    assert resolved.reader_options == {"verify": False}
    assert resolved.backend_kwargs == {"part_size": "1MiB"}
    opts = resolved.backend_options
    assert (opts.max_concurrency, opts.part_size, opts.fsync) == (3, 1 << 20, False)
    assert resolved.writer() == dcpstore.WriterOptions(overwrite=True)
    backend = resolved.open_backend()
    assert type(backend) is LocalBackend and backend.options == opts
    other = resolved.rebind(tmp_path / "d")
    assert other.location == str(tmp_path / "d") and other.options.part_size == 1 << 20
    # a bare backend takes backend options only and ignores a writer's query options
    with pytest.raises(TypeError, match="unknown option.*overwrite.*for backend 'file'"):
        resolve(tmp_path, overwrite=True)
    assert resolve(f"file://{tmp_path}?overwrite=1").writer_options == {}
    with pytest.raises(TypeError, match="unknown option.*verify.*valid options"):
        dcpstore.get_writer(tmp_path, verify=False)
    with pytest.raises(TypeError, match="unknown URI query option.*overwrite"):
        dcpstore.get_reader(f"file://{tmp_path}?overwrite=1")


#: The layers, lowest first: a module may import its own layer and the ones below it.
_LAYERS = {"errors": 0, "_version": 0, "_compat": 0, "torch_internals": 0, "storage": 1,
           "dcp": 2, "training": 3, "tools": 4, "integrations": 5, "testing": 5, "plugin": 5,
           "__init__": 6, "__main__": 6}


def test_no_layer_imports_a_layer_above_it() -> None:
    """storage < dcp < training < tools < integrations/testing: nothing imports upwards,
    not even lazily inside a function."""
    import ast

    root = Path(dcpstore.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        layer = _LAYERS[rel.parts[0].removesuffix(".py")]
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.split(".")[0] == "dcpstore"):
                continue
            parts = node.module.split(".")
            targets = parts[1:2] if len(parts) > 1 else [a.name for a in node.names]
            offenders += [f"{rel}:{node.lineno} imports {t}" for t in targets
                          if _LAYERS.get(t, -1) > layer]
    assert offenders == []


def test_one_file_per_rank_keeps_plan_order(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    def item_order(path: Path) -> list[str]:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
        assert len({info.relative_path for info in storage.values()}) == 1
        return [index.fqn for index, _ in sorted(storage.items(), key=lambda kv: kv[1].offset)]

    state = {"small": torch.ones(2), "big": torch.randn(4096), "extra": {"note": "x"},
             "mid": torch.randn(300), "tail": torch.zeros(1)}
    dcpstore.save(state, tmp_path / "ours")
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "torch")), no_dist=True)
    assert item_order(tmp_path / "ours") == item_order(tmp_path / "torch")
    tensors = [k for k in item_order(tmp_path / "ours") if k in state]
    assert tensors == ["small", "big", "mid", "tail"]  # the plan's order, not by size


def test_existing_checkpoint_message_matches_torch(tmp_path: Path) -> None:
    dcpstore.save({"w": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(dcpstore.CheckpointExistsError, match="Checkpoint already exists"):
        dcpstore.save({"w": torch.ones(2)}, tmp_path / "c")
