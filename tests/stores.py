"""The one store matrix of the reliability tests: local disk, moto, SeaweedFS,
fake-gcs-server, MSC (an S3 profile over the moto server) and Azure Blob Storage
(Azurite).

``tests/conftest.py`` turns :data:`STORE_NAMES` into the ``store`` fixture (one per
test, under a fresh prefix of the session's servers). A module that cannot run some of
them narrows the list with ``pytest.mark.parametrize("store", [...], indirect=True)``
and says why in one line.

:class:`Store` is :class:`dcpstore.testing.stores.RunningStore`, the one description
of a running store that the benchmarks' stores share.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dcpstore
from dcpstore.storage.local import LocalBackend
from dcpstore.testing import MemoryBackend
from dcpstore.testing.servers import isolate_env
from dcpstore.testing.stores import KINDS, msc_store_profile, tree_files, write_msc_config
from dcpstore.testing.stores import RunningStore as Store

__all__ = ["BUCKET", "KINDS", "MSC_PROFILE", "STORE_NAMES", "Store", "tree_files",
           "use_s3_server", "write_store_msc_config"]

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


def memory_scheme(bucket: str) -> Iterator[None]:
    """``memory://`` URIs served by :class:`MemoryBackend`, with ``bucket`` created (for a
    module-scoped fixture: ``yield from memory_scheme(BUCKET)``)."""
    dcpstore.register_backend("memory", MemoryBackend, clobber=True)
    MemoryBackend.create_bucket(bucket)
    yield
    MemoryBackend.delete_bucket(bucket)


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
                     server.env(), server, server.endpoint_url, bucket=BUCKET,
                     region=server.region)
    if name == "gcs":
        return Store("gcs", f"gs://{BUCKET}/{run}",
                     {"endpoint_url": server.endpoint_url, "token": "anon"},
                     {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}, server,
                     server.endpoint_url, bucket=BUCKET)
    if name == "msc":
        assert msc_config is not None
        # the profile carries the credentials; MSC_CONFIG reaches spawned ranks and the CLI
        return Store("msc", f"msc://{MSC_PROFILE}/{run}", {},
                     {"MSC_CONFIG": msc_config, **server.env()}, server, server.endpoint_url,
                     bucket=BUCKET, region=server.region, msc_config=msc_config)
    if name == "azure":
        # the connection string (Azurite on 127.0.0.1 only) reaches spawned ranks and the CLI
        return Store("azure", f"az://{BUCKET}/{run}", {}, server.env(), server,
                     server.upstream, bucket=BUCKET)
    raise ValueError(f"unknown store {name!r}; one of {', '.join(ALL_STORE_NAMES)}")


def write_store_msc_config(path: Path, server: Any) -> str:
    """Write the MSC configuration of the ``msc`` store (profile :data:`MSC_PROFILE`
    over ``server``'s bucket :data:`BUCKET`); return its path."""
    return write_msc_config(path, {"profiles": {MSC_PROFILE: msc_store_profile(server,
                                                                               BUCKET)}})


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


def use_s3_server(server: Any, monkeypatch: pytest.MonkeyPatch, *, readonly: bool = False
                  ) -> Any:
    """``server`` (an ``S3Server``) with its credentials in the environment (its
    read-only identity's with ``readonly``)."""
    for name, value in server.env(readonly=readonly).items():
        monkeypatch.setenv(name, value)
    return server
