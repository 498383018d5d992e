"""Options of the S3 backend and S3's size limits."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from dcpstore.backend import BackendOptions

__all__ = [
    "ADDRESSING_STYLES",
    "MAX_PARTS",
    "MAX_PART_SIZE",
    "MIN_PART_SIZE",
    "PREFIX_STRATEGIES",
    "S3Options",
]

MiB = 1024 * 1024
#: S3's smallest part (all parts but the last).
MIN_PART_SIZE = 5 * MiB
#: S3's largest part.
MAX_PART_SIZE = 5 * 1024 * MiB
#: S3's limit of parts per multipart upload.
MAX_PARTS = 10_000

ADDRESSING_STYLES = ("auto", "path", "virtual")
PREFIX_STRATEGIES = ("none", "hash")


@dataclass
class S3Options(BackendOptions):
    """Options of the S3 backend.

    Set them as keyword arguments (``dcpstore.get_writer(uri, region="eu-west-1")``), in
    the URI query (``s3://bucket/path?region=eu-west-1``) or as environment variables
    (``DCPSTORE_S3_REGION=eu-west-1``), in that order of precedence. Credentials are
    never options: they come from the standard AWS chain (environment, shared
    config/credentials files, ``profile``, SSO, instance/container roles).

    Attributes:
        endpoint_url: S3 endpoint, e.g. ``http://127.0.0.1:8333`` for SeaweedFS or
            MinIO. Default: botocore's resolution (``AWS_ENDPOINT_URL_S3``,
            ``AWS_ENDPOINT_URL``, the profile's ``endpoint_url``, else AWS).
        region: AWS region. Default: ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` / the
            profile's region.
        profile: Named profile of the shared AWS config files (default ``AWS_PROFILE``).
        addressing_style: ``"path"`` (``endpoint/bucket/key``), ``"virtual"``
            (``bucket.endpoint/key``) or ``"auto"`` (botocore decides).
        anonymous: Send unsigned requests (public buckets); no credentials are looked up.
        unsigned_payload: Do not SHA-256 the request bodies for the signature (TLS
            protects them in transit, and dcpstore's manifest CRC32C verifies every byte
            end to end); saves a full pass over the data. The client is configured with
            an explicit ``payload_signing_enabled``, which botocore's S3 signer obeys
            over HTTPS and plain HTTP alike.
        prefix_strategy: ``"none"``: data files live directly under the checkpoint
            root, as torch writes them. ``"hash"``: data files are spread over 256
            hashed sub-prefixes (``<root>/<hh>/__0_0.<id>.distcp``) to multiply S3's
            per-prefix request rate limits; transparent to dcpstore, not to torch's
            ``FsspecReader``.
        connect_timeout: Seconds to establish a connection.
        timeout: Seconds a request may wait for the server (per socket read) before it
            is abandoned and retried.
        max_attempts: Attempts per request, the first included (dcpstore retries with
            exponential backoff and jitter; botocore's own retries are off).
        part_size: Bytes per multipart-upload part (5 MiB .. 5 GiB). Objects smaller
            than one part are a single ``PutObject``. Largest object: part_size x 10,000.
        max_concurrency: Requests in flight at once per process: upload parts and
            ranged reads. Memory bound of a save: about ``part_size x
            (max_concurrency + files_per_rank)`` (parts in flight plus the part each
            open upload is filling); up to ``max_concurrency + 2`` part buffers are kept
            for reuse until the backend is closed (``dcpstore.save`` closes it).
    """

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    addressing_style: str = "auto"
    anonymous: bool = False
    unsigned_payload: bool = True
    prefix_strategy: str = "none"
    connect_timeout: float = 10.0
    timeout: float = 60.0
    max_attempts: int = 6
    part_size: int = 32 * MiB
    max_concurrency: int = 8

    def validate(self) -> None:
        """Raise ``ValueError`` for values S3 would refuse or that make no sense."""
        super().validate()
        if not MIN_PART_SIZE <= self.part_size <= MAX_PART_SIZE:
            raise ValueError(
                f"part_size must be between 5 MiB ({MIN_PART_SIZE}) and 5 GiB "
                f"({MAX_PART_SIZE}) for S3 multipart uploads, got {self.part_size}"
            )
        if self.addressing_style not in ADDRESSING_STYLES:
            raise ValueError(
                f"addressing_style must be one of {', '.join(ADDRESSING_STYLES)}, "
                f"got {self.addressing_style!r}"
            )
        if self.prefix_strategy not in PREFIX_STRATEGIES:
            raise ValueError(
                f"prefix_strategy must be one of {', '.join(PREFIX_STRATEGIES)}, "
                f"got {self.prefix_strategy!r}"
            )
        if self.connect_timeout <= 0:
            raise ValueError(f"connect_timeout must be > 0, got {self.connect_timeout}")
        if self.endpoint_url is not None:
            parts = urlsplit(self.endpoint_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(
                    "endpoint_url must be an http:// or https:// URL with a host, e.g. "
                    "http://127.0.0.1:8333"
                )
            if parts.username is not None or parts.password is not None:
                # never echo it: it carries a secret
                raise ValueError(
                    "endpoint_url carries credentials; credentials never belong in a URL. "
                    "Use AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile or a role."
                )
