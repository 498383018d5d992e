"""A running S3-compatible stand-in (:class:`S3Server`, from
:func:`~dcpstore.testing.servers.moto_server` or
:func:`~dcpstore.testing.servers.seaweedfs_server`), and an MSC profile over one."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["S3Server", "msc_s3_profile"]


@dataclass
class S3Server:
    """A running S3-compatible server.

    Attributes:
        kind: ``"moto"`` or ``"seaweedfs"``.
        endpoint_url: ``http://127.0.0.1:<port>`` (``https://`` when served with TLS).
        access_key: Access key id of an identity allowed everything.
        secret_key: Its secret.
        region: Region to sign for.
        readonly_access_key: An identity that may only read and list (``None`` when the
            server does not enforce permissions, like moto).
        readonly_secret_key: Its secret.
        enforces_auth: Whether wrong credentials or missing permissions are refused.
        data_dir: Directory holding the server's stored data (``None``: in memory), e.g.
            for a benchmark that drops its page cache.
        ca_bundle: PEM file of the CA whose certificate the server presents (``None``:
            plain HTTP). Clients trust it through ``AWS_CA_BUNDLE`` (see :meth:`env`).
    """

    kind: str
    endpoint_url: str
    access_key: str
    secret_key: str = field(repr=False)
    region: str = "us-east-1"
    readonly_access_key: str | None = None
    readonly_secret_key: str | None = field(default=None, repr=False)
    enforces_auth: bool = False
    data_dir: str | None = None
    ca_bundle: str | None = None

    def env(self, *, readonly: bool = False) -> dict[str, str]:
        """``AWS_*`` variables for clients of this server (and no real AWS config); with
        TLS also ``AWS_CA_BUNDLE``, which botocore, boto3, aiobotocore (s3fs) and MSC
        trust."""
        key, secret = (
            (self.readonly_access_key or "", self.readonly_secret_key or "")
            if readonly else (self.access_key, self.secret_key)
        )
        env = {
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
        if self.ca_bundle:
            env["AWS_CA_BUNDLE"] = self.ca_bundle
        return env

    def client(self) -> Any:
        """A botocore S3 client for this server (administrative use in tests)."""
        import botocore.session
        from botocore.config import Config

        session = botocore.session.Session()
        return session.create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            verify=self.ca_bundle,  # None: botocore's default trust
            config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 3},
                          connect_timeout=5, read_timeout=30),
        )

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (no error if it exists) and return its name."""
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except client.exceptions.BucketAlreadyExists:
            pass
        finally:
            client.close()
        return name

    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem`` (and torch's ``FsspecReader``)."""
        client_kwargs: dict[str, Any] = {"region_name": self.region}
        if self.ca_bundle:
            client_kwargs["verify"] = self.ca_bundle
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "endpoint_url": self.endpoint_url,
            "client_kwargs": client_kwargs,
        }


def msc_s3_profile(server: S3Server, bucket: str, *, endpoint: str | None = None,
                   credentials: bool = True, **options: Any) -> dict[str, Any]:
    """An MSC profile (a ``profiles`` entry) storing under ``bucket`` of ``server``.

    Args:
        server: The S3 server.
        bucket: The bucket (the profile's ``base_path``).
        endpoint: Endpoint to reach instead of the server's own (a proxy in front).
        credentials: Put the server's credentials in the profile; without them MSC's S3
            provider reads the same ``AWS_*`` environment as every other client.
        **options: More S3 provider options (``retries``, timeouts).
    """
    profile: dict[str, Any] = {"storage_provider": {"type": "s3", "options": {
        "base_path": bucket, "endpoint_url": endpoint or server.endpoint_url,
        "region_name": server.region, **options}}}
    if credentials:
        profile["credentials_provider"] = {"type": "S3Credentials", "options": {
            "access_key": server.access_key, "secret_key": server.secret_key}}
    return profile
