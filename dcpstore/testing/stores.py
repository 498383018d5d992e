"""A running stand-in store, described once for the tests and the benchmarks.

:class:`RunningStore` says where a store that is up keeps its checkpoints and how a
client reaches it: the test suite's store matrix (``tests/stores.py``, under the name
``Store``), the benchmark's stores (``benchmarks/servers.py``, whose ``StoreInfo`` adds
its counting proxy and MSC profiles) and the MSC backend's tests build on it. The
servers themselves come from :mod:`dcpstore.testing.servers` and
:mod:`dcpstore.testing.azurite`; :func:`write_msc_config` and :func:`msc_store_profile`
write the MSC configuration over one of them.

Nothing here imports pytest, dcpstore's API or a cloud client at import time (the
Azure SDK only in :meth:`RunningStore.files` of an Azure store)::

    store = RunningStore("moto", "s3://ckpt/run", {"endpoint_url": s3.endpoint_url},
                         s3.env(), s3, s3.endpoint_url, bucket="ckpt")
    dcpstore.save(state, store.uri("step"), **store.options)
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcpstore.testing.azurite import ACCOUNT as AZURITE_ACCOUNT
from dcpstore.testing.servers import gcs_object_names, msc_s3_profile

if TYPE_CHECKING:
    from typing_extensions import Self

    from dcpstore.storage.backend import Backend

__all__ = [
    "KINDS",
    "SCHEMES",
    "RunningStore",
    "msc_store_profile",
    "tree_files",
    "write_msc_config",
]

#: Store name -> the kind of client it is reached through.
KINDS = {"local": "local", "moto": "s3", "seaweedfs": "s3", "gcs": "gcs", "msc": "msc",
         "azure": "azure"}
#: Kind of store -> the URI scheme dcpstore serves it under.
SCHEMES = {"local": "file", "s3": "s3", "gcs": "gs", "msc": "msc", "azure": "az"}


def tree_files(root: str | os.PathLike[str]) -> list[str]:
    """Every file under a local directory, relative, sorted (none if it is missing)."""
    root = Path(root)
    if not root.exists():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def msc_store_profile(server: Any, bucket: str, *, endpoint: str | None = None,
                      retry_attempts: int | None = None, **options: Any) -> dict[str, Any]:
    """An MSC profile storing under ``bucket`` of an S3 server, with its credentials, two
    botocore attempts and short timeouts (:func:`~dcpstore.testing.servers.msc_s3_profile`).

    Args:
        server: The :class:`~dcpstore.testing.servers.S3Server`.
        bucket: The bucket (the profile's ``base_path``).
        endpoint: Endpoint to reach instead of the server's own (a proxy in front).
        retry_attempts: Attempts of MSC's own retry layer (``None``: MSC's default).
        **options: More S3 provider options.
    """
    profile = msc_s3_profile(server, bucket, endpoint=endpoint, retries={"max_attempts": 2},
                             connect_timeout=5, read_timeout=30, **options)
    if retry_attempts is not None:
        profile["retry"] = {"attempts": retry_attempts, "delay": 0.05}
    return profile


def write_msc_config(path: str | os.PathLike[str], config: dict[str, Any]) -> str:
    """Write an MSC configuration (``{"profiles": ..., "path_mapping": ...}``).

    YAML when PyYAML is installed (MSC needs it), else JSON, which YAML readers read too.

    Args:
        path: The file (MSC caches what it read per path: write a new one to change it).
        config: The configuration.

    Returns:
        ``path``, for ``MSC_CONFIG`` or a ``config`` backend option.
    """
    try:
        import yaml
    except ImportError:
        text = json.dumps(config, indent=1)
    else:
        text = yaml.safe_dump(config)
    Path(path).write_text(text)
    return os.fspath(path)


@dataclasses.dataclass(frozen=True)
class RunningStore:
    """A store that is up: where its checkpoints go and how its clients reach it.

    Picklable while :attr:`server` is ``None`` or an ``S3Server`` (a description sent to
    other processes leaves the server out).

    Attributes:
        name: A key of :data:`KINDS`: ``local``, ``moto``, ``seaweedfs``, ``gcs``,
            ``msc`` or ``azure``.
        root: Where checkpoints go: a local directory, a URI prefix
            (``s3://bucket/run``), or a bucket's name alone, meaning its top
            (:attr:`root_uri` is always a directory or a URI).
        options: Backend options for every dcpstore call (``endpoint_url`` of S3 and
            GCS stores; none for MSC and Azure, whose clients read :attr:`env`).
        env: Environment its clients need (credentials, ``MSC_CONFIG``, under TLS the
            CA); set it for a test and pass it to spawned processes.
        server: The server (``S3Server``, ``FakeGCSServer``, ``AzuriteServer``;
            ``None`` for local, and where the description is sent to other processes).
        upstream: The server's HTTP endpoint, for a proxy in front of it (``None`` for
            local; Azurite's is the server, ``http://127.0.0.1:<port>``, without the
            account's path).
        bucket: The bucket (container) on the server that :attr:`root` lies in; for
            MSC, the bucket its profile stores in (``None`` for local).
        region: Region S3 clients sign for.
        ca_bundle: CA a client must trust to reach the store over HTTPS (``None``:
            plain HTTP, or the local store).
        msc_config: Path of the MSC configuration holding this store's profiles
            (``None``: none written).
    """

    name: str
    root: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    server: Any = None
    upstream: str | None = None
    bucket: str | None = None
    region: str = "us-east-1"
    ca_bundle: str | None = None
    msc_config: str | None = None

    @property
    def kind(self) -> str:
        """``local``, ``s3``, ``gcs``, ``msc`` or ``azure``."""
        return KINDS[self.name]

    @property
    def scheme(self) -> str:
        """``file``, ``s3``, ``gs``, ``msc`` or ``az``."""
        return SCHEMES[self.kind]

    @property
    def root_uri(self) -> str:
        """:attr:`root` as a directory (local) or a URI (``<scheme>://bucket[/prefix]``)."""
        if self.kind == "local" or "://" in self.root:
            return self.root
        return f"{self.scheme}://{self.root}"

    @property
    def endpoint_url(self) -> str | None:
        """The ``endpoint_url`` option: where its clients reach the server (a proxy's
        after :meth:`via`; ``None`` where no option carries it)."""
        return self.options.get("endpoint_url")

    def uri(self, tag: str) -> str:
        """A fresh location under :attr:`root`."""
        return f"{self.root_uri.rstrip('/')}/{tag}-{uuid.uuid4().hex[:8]}"

    def backend(self, uri: str | None = None) -> Backend:
        """A dcpstore backend for ``uri`` (default :attr:`root_uri`) with :attr:`options`."""
        from dcpstore.storage.resolve import open_backend

        return open_backend(uri or self.root_uri, **self.options)

    def cli_options(self) -> list[str]:
        """``-o KEY=VALUE`` arguments of the ``dcpstore`` CLI for :attr:`options`."""
        return [arg for k, v in self.options.items() for arg in ("-o", f"{k}={v}")]

    def via(self, endpoint: str, *, msc_retry_attempts: int | None = None) -> Self:
        """The same store reached through ``endpoint`` (a proxy in front of the server).

        Args:
            endpoint: The proxy's ``http://127.0.0.1:<port>``.
            msc_retry_attempts: Attempts of MSC's own retry layer (MSC stores: its
                profile, under the same name, comes as a ``config`` option over
                ``MSC_CONFIG``; dcpstore's ``max_attempts`` come on top).

        Returns:
            A copy of this store (of its own type) whose clients go through ``endpoint``.

        Raises:
            ValueError: The store has no HTTP endpoint (local).
        """
        if self.upstream is None:
            raise ValueError(f"the {self.name} store has no HTTP endpoint to put a proxy before")
        if self.kind == "azure":  # Azurite serves the account path-style
            return dataclasses.replace(self, options={
                **self.options, "endpoint_url": f"{endpoint.rstrip('/')}/{AZURITE_ACCOUNT}"})
        if self.kind != "msc":
            return dataclasses.replace(self, options={**self.options, "endpoint_url": endpoint})
        assert self.bucket is not None, "an MSC store names the bucket its profile uses"
        profile = self.root_uri.split("://", 1)[1].partition("/")[0]
        config = {"profiles": {profile: msc_store_profile(
            self.server, self.bucket, endpoint=endpoint, retry_attempts=msc_retry_attempts)}}
        return dataclasses.replace(self, options={**self.options, "config": config})

    # -- what the store itself holds (raw, not through dcpstore) --------------------------

    def _bucket_prefix(self, uri: str) -> tuple[str, str]:
        rest = uri.split("://", 1)[1]
        bucket, _, prefix = rest.partition("/")
        if self.kind == "msc":
            bucket = str(self.bucket)  # the profile's base_path
        return bucket, prefix.rstrip("/") + "/"

    def files(self, uri: str) -> set[str]:
        """Every object under ``uri`` as the store itself lists it (relative)."""
        if self.kind == "local":
            return set(tree_files(uri))
        bucket, prefix = self._bucket_prefix(uri)
        if self.kind == "gcs":
            names = gcs_object_names(self.upstream or "", bucket, prefix,
                                     ca_bundle=self.ca_bundle)
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
