"""The one store matrix of the reliability tests: local disk, moto, SeaweedFS,
fake-gcs-server, MSC (an S3 profile over the moto server) and Azure Blob Storage
(Azurite).

``tests/conftest.py`` turns :data:`STORE_NAMES` into the ``store`` fixture (one per
test, under a fresh prefix of the session's servers). A module that cannot run some of
them narrows the list with ``pytest.mark.parametrize("store", [...], indirect=True)``
and says why in one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dcpstore
from dcpstore.storage.backend import Backend
from dcpstore.storage.local import LocalBackend
from dcpstore.testing import MemoryBackend
from dcpstore.testing.azurite import ACCOUNT as AZURITE_ACCOUNT
from dcpstore.testing.servers import gcs_object_names, isolate_env, msc_s3_profile

__all__ = ["BUCKET", "MSC_PROFILE", "STORE_NAMES", "Store", "tree_files"]

#: Bucket every server store uses (created once per session).
BUCKET = "dcpstore-test"
#: The buckets the S3 and GCS tests use, and Azurite's container (the same name on every
#: server).
S3_TEST_BUCKET = GCS_TEST_BUCKET = AZURE_TEST_CONTAINER = BUCKET
#: The MSC profile of the ``msc`` store (an S3 profile over moto, bucket :data:`BUCKET`).
MSC_PROFILE = "dcpstore-test"
#: Every store, in the order tests run them.
ALL_STORE_NAMES = ("local", "moto", "seaweedfs", "gcs", "msc", "azure")


def _chosen_stores() -> tuple[str, ...]:
    """``DCPSTORE_TEST_STORES=local,moto,seaweedfs`` narrows the store matrix (the torch
    matrix's venvs hold the S3 plugin alone: the other plugins' code does not depend on
    the torch release, and runs in the development venv)."""
    chosen = os.environ.get("DCPSTORE_TEST_STORES")
    if not chosen:
        return ALL_STORE_NAMES
    names = tuple(n.strip() for n in chosen.split(",") if n.strip())
    unknown = [n for n in names if n not in ALL_STORE_NAMES]
    if unknown:
        raise ValueError(f"DCPSTORE_TEST_STORES: unknown store(s) {unknown}; "
                         f"known: {', '.join(ALL_STORE_NAMES)}")
    return names


#: The stores the ``store`` fixture runs a test on.
STORE_NAMES = _chosen_stores()
#: Kind of client each store is reached through.
KINDS = {"local": "local", "moto": "s3", "seaweedfs": "s3", "gcs": "gcs", "msc": "msc",
         "azure": "azure"}


def memory_scheme(bucket: str) -> Iterator[None]:
    """``memory://`` URIs served by :class:`MemoryBackend`, with ``bucket`` created (for a
    module-scoped fixture: ``yield from memory_scheme(BUCKET)``)."""
    dcpstore.register_backend("memory", MemoryBackend, clobber=True)
    MemoryBackend.create_bucket(bucket)
    yield
    MemoryBackend.delete_bucket(bucket)


def tree_files(root: str | Path) -> list[str]:
    """Every file under a local directory, relative, sorted."""
    root = Path(root)
    if not root.exists():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def msc_profile(server: Any, endpoint: str | None = None,
                retry_attempts: int | None = None) -> dict[str, Any]:
    """The ``msc`` store's profile (through ``endpoint`` instead of the server's own;
    with ``retry_attempts``, MSC's own retry section)."""
    profile = msc_s3_profile(server, BUCKET, endpoint=endpoint, retries={"max_attempts": 2},
                             connect_timeout=5, read_timeout=30)
    if retry_attempts is not None:
        profile["retry"] = {"attempts": retry_attempts, "delay": 0.05}
    return profile


@dataclasses.dataclass
class Store:
    """One store of the matrix, under a prefix of its own for one test.

    Attributes:
        name: ``local``, ``moto``, ``seaweedfs``, ``gcs``, ``msc`` or ``azure``.
        root: Where this test's checkpoints go (a directory or a URI prefix).
        options: Backend options for every dcpstore call.
        env: Environment its clients need (set for the test; pass it to spawned ranks).
        server: The server (``S3Server`` / ``FakeGCSServer`` / ``AzuriteServer``;
            ``None`` for local).
        upstream: The server's HTTP endpoint (``None`` for local; Azurite's is the
            server, ``http://127.0.0.1:<port>``, without the account's path).
    """

    name: str
    root: str
    options: dict[str, Any]
    env: dict[str, str]
    server: Any = None
    upstream: str | None = None

    @property
    def kind(self) -> str:
        """``local``, ``s3``, ``gcs``, ``msc`` or ``azure``."""
        return KINDS[self.name]

    @property
    def scheme(self) -> str:
        return {"local": "file", "s3": "s3", "gcs": "gs", "msc": "msc",
                "azure": "az"}[self.kind]

    def uri(self, tag: str) -> str:
        """A fresh location under :attr:`root`."""
        return f"{self.root.rstrip('/')}/{tag}-{uuid.uuid4().hex[:8]}"

    def backend(self, uri: str | None = None) -> Backend:
        return dcpstore.open_backend(uri or self.root, **self.options)

    def cli_options(self) -> list[str]:
        """``-o KEY=VALUE`` arguments of the ``dcpstore`` CLI for :attr:`options`."""
        return [arg for k, v in self.options.items() for arg in ("-o", f"{k}={v}")]

    def via(self, endpoint: str, *, msc_retry_attempts: int | None = None) -> Store:
        """The same store reached through ``endpoint`` (a proxy in front of the server).

        ``msc_retry_attempts`` sets the attempts of MSC's own retry layer (MSC retries
        in the profile; dcpstore's ``max_attempts`` of the MSC backend come on top)."""
        if self.upstream is None:
            raise ValueError(f"the {self.name} store has no HTTP endpoint to put a proxy before")
        if self.kind == "azure":  # Azurite serves the account path-style
            return dataclasses.replace(self, options={
                **self.options, "endpoint_url": f"{endpoint.rstrip('/')}/{AZURITE_ACCOUNT}"})
        if self.kind != "msc":
            return dataclasses.replace(self, options={**self.options, "endpoint_url": endpoint})
        # the same profile name (so the same URIs), from a config option over MSC_CONFIG
        config = {"profiles": {MSC_PROFILE: msc_profile(self.server, endpoint,
                                                        msc_retry_attempts)}}
        return dataclasses.replace(self, options={**self.options, "config": config})

    # -- what the store itself holds (raw, not through dcpstore) --------------------------

    def _bucket_prefix(self, uri: str) -> tuple[str, str]:
        rest = uri.split("://", 1)[1]
        bucket, _, prefix = rest.partition("/")
        if self.kind == "msc":
            bucket = BUCKET  # the profile's base_path
        return bucket, prefix.rstrip("/") + "/"

    def files(self, uri: str) -> set[str]:
        """Every object under ``uri`` as the store itself lists it (relative)."""
        if self.kind == "local":
            return set(tree_files(uri))
        bucket, prefix = self._bucket_prefix(uri)
        if self.kind == "gcs":
            names = gcs_object_names(self.upstream or "", bucket, prefix)
            return {name[len(prefix):] for name in names}
        if self.kind == "azure":
            container = self._container(bucket)
            try:  # committed blobs only: staged, uncommitted blocks are not objects
                return {b.name[len(prefix):] for b in container.list_blobs(
                    name_starts_with=prefix)}
            finally:
                container.close()
        client = self.server.client()
        try:
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                      Prefix=prefix)
            return {o["Key"][len(prefix):] for p in pages for o in p.get("Contents", ())}
        finally:
            client.close()

    def _container(self, container: str) -> Any:
        """An SDK ``ContainerClient`` of Azurite (its connection string; no retries)."""
        from azure.storage.blob import ContainerClient

        return ContainerClient.from_connection_string(
            self.server.connection_string(), container, retry_total=0)

    def uploads(self, uri: str) -> list[str]:
        """Unfinished multipart uploads under ``uri`` (S3 ``ListMultipartUploads``; local
        files and GCS resumable uploads leave none that can be listed, and Azure's
        uncommitted blocks are no object: they go at the blob's next commit or after 7
        days)."""
        if self.kind in ("local", "gcs", "azure"):
            return []
        bucket, prefix = self._bucket_prefix(uri)
        client = self.server.client()
        try:
            response = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix)
            return [u["Key"] for u in response.get("Uploads", ())]
        finally:
            client.close()


def make_store(name: str, area: str, local_dir: Path, servers: dict[str, Any],
               msc_config: str | None) -> Store:
    """A :class:`Store` for one test: ``area`` names the module, ``servers`` holds the
    session's servers by store name."""
    run = f"{area}/{uuid.uuid4().hex[:12]}"
    if name == "local":
        return Store("local", str(local_dir), {}, {})
    server = servers[name]
    if name in ("moto", "seaweedfs"):
        return Store(name, f"s3://{BUCKET}/{run}", {"endpoint_url": server.endpoint_url},
                     server.env(), server, server.endpoint_url)
    if name == "gcs":
        return Store("gcs", f"gs://{BUCKET}/{run}",
                     {"endpoint_url": server.endpoint_url, "token": "anon"},
                     {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}, server,
                     server.endpoint_url)
    if name == "msc":
        assert msc_config is not None
        # the profile carries the credentials; MSC_CONFIG reaches spawned ranks and the CLI
        return Store("msc", f"msc://{MSC_PROFILE}/{run}", {},
                     {"MSC_CONFIG": msc_config, **server.env()}, server, server.endpoint_url)
    if name == "azure":
        # the connection string (Azurite on 127.0.0.1 only) reaches spawned ranks and the CLI
        return Store("azure", f"az://{BUCKET}/{run}", {}, server.env(), server,
                     server.upstream)
    raise ValueError(f"unknown store {name!r}; one of {', '.join(ALL_STORE_NAMES)}")


def write_msc_config(path: Path, server: Any) -> str:
    """Write the MSC configuration of the ``msc`` store; return its path."""
    path.write_text(json.dumps({"profiles": {MSC_PROFILE: msc_profile(server)}}, indent=1))
    return os.fspath(path)


def full_requested(config: pytest.Config) -> bool:
    """Whether the long randomized runs were asked for (usable at collection time)."""
    return bool(config.getoption("--full")) or os.environ.get(
        "DCPSTORE_TEST_FULL", "") not in ("", "0")


_SERVER_FIXTURES = {"moto": "moto_s3", "seaweedfs": "seaweedfs_s3", "gcs": "gcs_server",
                    "msc": "moto_s3", "azure": "azurite_blob"}


def build_store(name: str, request: pytest.FixtureRequest, tmp_path: Path,
                monkeypatch: pytest.MonkeyPatch) -> Store:
    """Store ``name`` for the requesting test, under a fresh prefix, with a clean
    environment holding only what its clients need (spawned ranks get
    :attr:`Store.env`). The ``store`` fixture's body, for modules that choose the store
    by another parameter (test_crash: per store and seed)."""
    servers: dict[str, Any] = {}
    if name in _SERVER_FIXTURES:
        servers[name] = request.getfixturevalue(_SERVER_FIXTURES[name])
    msc_config = request.getfixturevalue("msc_config_file") if name == "msc" else None
    area = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    found = make_store(name, area, tmp_path / "store", servers, msc_config)
    # a module's STORE_OPTIONS = {kind: options} adds options per kind of store
    extra = getattr(request.module, "STORE_OPTIONS", {}).get(found.kind, {})
    found.options.update(extra)
    isolate_env(monkeypatch, extra=found.env)
    return found


class GatedBackend(LocalBackend):
    """Local files whose data uploads wait for a gate (a slow store)."""

    name = "gated"
    schemes = ("gated",)
    gate = threading.Event()

    @classmethod
    def from_uri(cls, uri: Any, options: Any) -> Any:
        return cls("/" + uri.location, options)

    def _open_upload(self, key: str) -> Any:
        assert self.gate.wait(30)
        return super()._open_upload(key)
