"""The stores the benchmark runs against, all on this machine.

- ``local``: a directory on the local disk (``--local-dir``, default a temporary one);
- ``seaweedfs``: SeaweedFS's S3 gateway (``weed mini``), the main S3 stand-in;
- ``moto``: moto's S3 server (in memory, slow: runs a smaller state by default);
- ``gcs``: fake-gcs-server (its ``memory`` backend: every object is held in RAM).

The servers are the test suite's own (:mod:`dcpstore.testing.servers`), bound to
127.0.0.1 on free ports. With request counting on, each server also gets a
:class:`dcpstore.testing.FaultProxy` with no faults in front of it, used only by the
untimed counting runs. Every client gets the server's credentials the same way: the
``AWS_*`` environment variables of :meth:`S3Server.env` (endpoints are passed to each
client explicitly, since not all of them read ``AWS_ENDPOINT_URL``).

With ``tls`` (``--tls``) every server serves HTTPS only, with a certificate for
127.0.0.1 issued by one throwaway CA for the whole run (:mod:`dcpstore.testing.tls`),
and every client trusts that CA the same way, through the store's environment:
``AWS_CA_BUNDLE`` (botocore, boto3, aiobotocore/s3fs, MSC) and ``SSL_CERT_FILE``
(aiohttp for gcsfs, dcpstore's GCS backend and the GCS limit; the CRT clients of
s3torchconnector and the CRT limit). The counting proxy then serves HTTPS with the same
certificate and reaches its server over HTTPS, so the counted runs go through TLS too.

A store is described by :class:`StoreInfo`, the test suite's store description
(:class:`dcpstore.testing.stores.RunningStore`) with the counting proxy and MSC profiles
of the benchmark added.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import ssl
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dcpstore.testing.servers import (
    S3Server,
    fake_gcs_server,
    gcs_object_names,
    moto_server,
    seaweedfs_server,
)
from dcpstore.testing.stores import KINDS, RunningStore, write_msc_config
from dcpstore.testing.tls import TLSFiles

from . import pagecache
from .wire import msc_part_profile, msc_profile

__all__ = ["BUCKET", "SERVER_BUDGETS", "STORE_KINDS", "StoreInfo", "Stores"]

logger = logging.getLogger(__name__)

#: Bucket every server store uses.
BUCKET = "dcpstore-bench"
#: Store name -> kind of store (the stores the benchmark runs on).
STORE_KINDS = {name: KINDS[name] for name in ("local", "seaweedfs", "moto", "gcs")}
#: Bytes written to a server before :meth:`Stores.reserve` replaces it by a fresh one:
#: ``weed mini`` reclaims deleted objects' space only lazily (after ~80 GiB of writes it
#: answered InternalError to every client for about a minute); the in-memory servers
#: free what is deleted.
SERVER_BUDGETS = {"seaweedfs": 32 << 30}


@dataclass(frozen=True)
class StoreInfo(RunningStore):
    """Everything a rank needs to reach a store (picklable; sent with every job).

    A :class:`~dcpstore.testing.stores.RunningStore` whose :attr:`root` is the directory
    (local) or the bucket alone (servers), whose :attr:`endpoint_url` is the server's
    (or its counting proxy's in :meth:`counted`), and whose :attr:`server` stays with
    :class:`Stores` (``None``). Under TLS :attr:`env` also holds the CA
    (``AWS_CA_BUNDLE`` and ``SSL_CERT_FILE``), and :attr:`msc_config` is the MSC
    configuration with this store's profiles.

    Attributes:
        msc_profile: MSC profile reaching the server directly.
        msc_profile_counted: MSC profile reaching it through the counting proxy.
        proxy_url: The counting proxy's endpoint (``None`` when counting is off).
    """

    msc_profile: str | None = None
    msc_profile_counted: str | None = None
    proxy_url: str | None = None

    def counted(self) -> StoreInfo:
        """The same store reached through its counting proxy."""
        if self.proxy_url is None:
            raise ValueError(f"store {self.name} has no counting proxy")
        return replace(self.via(self.proxy_url), msc_profile=self.msc_profile_counted)


class Stores:
    """Start the stores that are asked for; stop them on exit.

    Args:
        names: Store names (keys of :data:`STORE_KINDS`).
        workdir: Where the MSC configuration is written.
        local_dir: Directory of the ``local`` store (default: a new temporary one).
        count_requests: Put a counting proxy in front of every server.
        budgets: Bytes a store's server may take before :meth:`reserve` replaces it by
            a fresh one (default: :data:`SERVER_BUDGETS`; a store not named has none).
        msc_part_sizes: Part sizes MSC profiles are also written for (profile
            ``<profile>-part<bytes>``: ``multipart_threshold`` and ``multipart_chunksize``
            of that size), for the ``msc`` peer's tuning grid.
        tls: Serve every server (and counting proxy) over HTTPS with a certificate of
            this CA (``None``: plain HTTP); clients get :meth:`TLSFiles.client_env`.
    """

    def __init__(self, names: list[str], workdir: Path, *, local_dir: str | None = None,
                 count_requests: bool = True, msc_part_sizes: tuple[int, ...] = (),
                 budgets: dict[str, int] | None = None, tls: TLSFiles | None = None) -> None:
        self.names = names
        self.tls = tls
        self.msc_part_sizes = tuple(msc_part_sizes)
        self.workdir = workdir
        self.local_dir = local_dir
        self.count_requests = count_requests
        self.info: dict[str, StoreInfo] = {}
        self.proxies: dict[str, Any] = {}
        self._servers: dict[str, Any] = {}
        #: store -> its S3 server's administrative client (for :meth:`delete`): one per
        #: server, not one per deletion (a botocore client takes ~0.1 s to build)
        self._admin: dict[str, Any] = {}
        self.budgets = dict(SERVER_BUDGETS if budgets is None else budgets)
        #: store -> bytes written to its current server (see :meth:`reserve`)
        self.written: dict[str, int] = {}
        #: store -> how often its server was replaced by a fresh one
        self.restarts: dict[str, int] = {}
        self._stacks: dict[str, contextlib.ExitStack] = {}
        self._stack = contextlib.ExitStack()
        self._own_local_dir: str | None = None

    def __enter__(self) -> Stores:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for admin in self._admin.values():
            admin.close()
        self._admin.clear()
        self._stack.close()
        if self._own_local_dir is not None:
            shutil.rmtree(self._own_local_dir, ignore_errors=True)

    def _proxy(self, name: str, upstream: str, stack: contextlib.ExitStack) -> str | None:
        if not self.count_requests:
            return None
        from dcpstore.testing import FaultProxy

        tls = self.tls
        proxy = stack.enter_context(FaultProxy(
            upstream, tls=tls.server_context() if tls else None,
            upstream_tls=tls.client_context() if tls else None))
        self.proxies[name] = proxy
        return str(proxy.endpoint_url)

    def _start(self) -> None:
        for name in self.names:
            self._start_one(name)
        self._write_msc_config()

    def _start_one(self, name: str) -> None:
        """Start store ``name`` (its server and counting proxy in a stack of their own,
        so that :meth:`replace` can stop them alone)."""
        kind = STORE_KINDS[name]
        stack = self._stack.enter_context(contextlib.ExitStack())
        self._stacks[name] = stack
        generation = self.restarts.get(name, 0)
        tls = self.tls or False
        tls_env = self.tls.client_env() if self.tls else {}
        ca_bundle = self.tls.ca_bundle if self.tls else None
        if kind == "local":
            root = self.local_dir
            if root is None:
                root = self._own_local_dir = tempfile.mkdtemp(prefix="dcpstore-bench-")
            os.makedirs(root, exist_ok=True)
            self.info[name] = StoreInfo(name, os.path.abspath(root))
        elif kind == "s3":
            server: S3Server
            if name == "seaweedfs":
                server = stack.enter_context(seaweedfs_server(bucket=BUCKET, tls=tls))
            else:
                server = stack.enter_context(moto_server(tls=tls))
                server.create_bucket(BUCKET)
            self._servers[name] = server
            proxy = self._proxy(name, server.endpoint_url, stack)
            # a replaced server gets new profile names: MSC caches its clients by
            # profile in every rank process, which would keep the old endpoint
            profile = f"bench-{name}" + (f"-g{generation}" if generation else "")
            self.info[name] = StoreInfo(
                name, BUCKET, {"endpoint_url": server.endpoint_url},
                {**server.env(), **tls_env}, upstream=server.endpoint_url, bucket=BUCKET,
                region=server.region, ca_bundle=ca_bundle, msc_profile=profile,
                msc_profile_counted=profile + "-counted" if proxy else None,
                proxy_url=proxy)
        elif kind == "gcs":
            gcs = stack.enter_context(fake_gcs_server(tls=tls))
            gcs.create_bucket(BUCKET)
            self._servers[name] = gcs
            proxy = self._proxy(name, gcs.endpoint_url, stack)
            self.info[name] = StoreInfo(
                name, BUCKET, {"endpoint_url": gcs.endpoint_url, "token": "anon"},
                {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", **tls_env},
                upstream=gcs.endpoint_url, bucket=BUCKET, ca_bundle=ca_bundle,
                proxy_url=proxy)
        else:  # pragma: no cover - names are validated by the CLI
            raise ValueError(f"unknown store {name!r}")
        self.written[name] = 0
        logger.info("store %s ready: %s", name, self.info[name].endpoint_url
                    or self.info[name].root)

    def _write_msc_config(self) -> None:
        """Write the MSC configuration of every S3 store's profiles (a new file after a
        replacement: MSC caches what it read per ``MSC_CONFIG`` path)."""
        profiles: dict[str, Any] = {}
        for info in self.info.values():
            if info.kind != "s3" or info.endpoint_url is None:
                continue
            endpoints = {str(info.msc_profile): info.endpoint_url}
            if info.proxy_url is not None and info.msc_profile_counted:
                endpoints[info.msc_profile_counted] = info.proxy_url
            for base, endpoint in endpoints.items():
                profiles[base] = msc_profile(endpoint, info.region, BUCKET)
                for part in self.msc_part_sizes:
                    profiles[msc_part_profile(base, part)] = msc_profile(
                        endpoint, info.region, BUCKET, part_size=part)
        if not profiles:
            return
        replaced = sum(self.restarts.values())
        config = self.workdir / ("msc_config.yaml" if not replaced
                                 else f"msc_config-r{replaced}.yaml")
        write_msc_config(config, {"profiles": profiles})
        for name, info in self.info.items():
            if info.kind == "s3":
                self.info[name] = replace(info, msc_config=str(config))

    # -- fresh servers ----------------------------------------------------------------------

    def replace(self, name: str) -> None:
        """Stop store ``name``'s server (and counting proxy) and start a fresh, empty one
        on new ports; :attr:`info` then describes the new one. Everything stored there
        is gone."""
        stack = self._stacks.pop(name)
        self._servers.pop(name, None)
        admin = self._admin.pop(name, None)
        if admin is not None:
            admin.close()
        self.proxies.pop(name, None)
        stack.close()
        self.restarts[name] = self.restarts.get(name, 0) + 1
        self._start_one(name)
        self._write_msc_config()

    def reserve(self, name: str, nbytes: int) -> bool:
        """Account ``nbytes`` about to be written to store ``name``. When that would take
        it past its budget (:attr:`budgets`), the server is replaced by a fresh one first
        (:meth:`replace`): SeaweedFS does not reclaim deleted objects' space until a
        vacuum, and after ~80 GiB of writes it answered InternalError to every client
        for about a minute. Call it only between cases, when nothing is stored there
        that a later job needs.

        Returns:
            Whether the server was replaced.
        """
        budget = self.budgets.get(name)
        replaced = False
        if budget is not None and self.written[name] and \
                self.written[name] + nbytes > budget:
            logger.info("store %s: %d bytes written, replacing its server", name,
                        self.written[name])
            self.replace(name)
            replaced = True
        self.written[name] += nbytes
        return replaced

    # -- housekeeping (untimed, from the orchestrator) ------------------------------------

    def delete(self, name: str, path: str) -> None:
        """Delete everything under ``path`` of store ``name`` (a finished case)."""
        info = self.info[name]
        try:
            if info.kind == "local":
                shutil.rmtree(os.path.join(info.root, path), ignore_errors=True)
            elif info.kind == "s3":
                if name not in self._admin:
                    self._admin[name] = self._servers[name].client()
                _s3_delete_prefix(self._admin[name], info.root, path.rstrip("/") + "/")
            else:
                _gcs_delete_prefix(info, path.rstrip("/") + "/")
        except Exception as exc:  # cleanup must not fail the benchmark
            logger.warning("could not delete %s from %s: %s", path, name, exc)

    def evict(self, name: str, path: str) -> None:
        """Drop the page cache of what a load of ``path`` from store ``name`` would read
        (:func:`benchmarks.pagecache.evict`), so the load reads the disk rather than
        memory: the checkpoint's files on the local store, every file of the server's
        data directory on SeaweedFS. The in-memory servers (moto, fake-gcs-server) have
        no files to drop."""
        info = self.info[name]
        if info.kind == "local":
            pagecache.evict([os.path.join(info.root, path)])
            return
        data_dir = getattr(self._servers.get(name), "data_dir", None)
        if data_dir:
            pagecache.evict([data_dir])

    def describe(self) -> dict[str, Any]:
        """JSON-ready description of each store (no secrets)."""
        out: dict[str, Any] = {}
        for name, info in self.info.items():
            server = self._servers.get(name)
            out[name] = {"kind": info.kind, "root": info.root,
                         "endpoint_url": info.endpoint_url,
                         "server": getattr(server, "kind", None) or name,
                         "counting_proxy": info.proxy_url is not None,
                         "tls": info.ca_bundle is not None,
                         "budget_bytes": self.budgets.get(name),
                         "fresh_restarts": self.restarts.get(name, 0)}
        return out


def _s3_delete_prefix(client: Any, bucket: str, prefix: str) -> None:
    for upload in client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get(
            "Uploads", []):
        with contextlib.suppress(Exception):
            client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"],
                                          UploadId=upload["UploadId"])
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        if token:
            kwargs["ContinuationToken"] = token
        page = client.list_objects_v2(**kwargs)
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
        if not page.get("IsTruncated"):
            break
        token = page.get("NextContinuationToken")


def _gcs_delete_prefix(info: StoreInfo, prefix: str) -> None:
    base = f"{info.endpoint_url}/storage/v1/b/{info.root}/o"
    context = ssl.create_default_context(cafile=info.ca_bundle) if info.ca_bundle else None
    for name in gcs_object_names(info.endpoint_url or "", info.root, prefix,
                                 ca_bundle=info.ca_bundle):
        req = urllib.request.Request(f"{base}/{urllib.parse.quote(name, safe='')}",
                                     method="DELETE")
        with contextlib.suppress(Exception), urllib.request.urlopen(req, timeout=30,
                                                                    context=context):
            pass
