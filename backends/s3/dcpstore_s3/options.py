"""Options of the S3 backend and S3's size limits."""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from dcpstore.plugin import ConfigurationError, StoreLimits, StoreOptions
from dcpstore.plugin import load_customer_key as _load_key

__all__ = [
    "ADDRESSING_STYLES",
    "LIMITS",
    "MAX_PARTS",
    "MAX_PART_SIZE",
    "MIN_PART_SIZE",
    "PART_GROWTH",
    "PREFIX_STRATEGIES",
    "SSE_ALGORITHMS",
    "S3Options",
    "encryption_params",
    "largest_object",
    "load_customer_key",
]

MiB = 1024 * 1024
#: S3's smallest part (all parts but the last).
MIN_PART_SIZE = 5 * MiB
#: S3's largest part.
MAX_PART_SIZE = 5 * 1024 * MiB
#: S3's limit of parts per multipart upload.
MAX_PARTS = 10_000
#: Part-size growth of a multipart upload, ``(after part, factor)``: ``part_size`` for
#: parts 1-1,000, twice it up to part 2,000, then 4x: what the framework does for
#: ``LIMITS.max_parts`` (2x after a tenth of them, 4x after a fifth).
PART_GROWTH = ((1_000, 2), (2_000, 4))
#: What S3 accepts; the framework sizes parts (and their growth) and single PUTs by it.
LIMITS = StoreLimits(max_put_size=MAX_PART_SIZE, max_parts=MAX_PARTS,
                     min_part_size=MIN_PART_SIZE, max_part_size=MAX_PART_SIZE)


def largest_object(part_size: int) -> int:
    """The largest object a multipart upload starting at ``part_size`` can store."""
    def part(number: int) -> int:
        factor = max((f for after, f in PART_GROWTH if number > after), default=1)
        return min(MAX_PART_SIZE, part_size * factor)

    return sum(part(n) for n in range(1, MAX_PARTS + 1))

ADDRESSING_STYLES = ("auto", "path", "virtual")
PREFIX_STRATEGIES = ("none", "hash")
#: Values of ``sse`` (S3's ``x-amz-server-side-encryption``): SSE-S3, SSE-KMS, DSSE-KMS.
SSE_ALGORITHMS = ("AES256", "aws:kms", "aws:kms:dsse")
#: The options that name an SSE-C key (for messages).
CUSTOMER_KEY_OPTIONS = "sse_customer_key_file or sse_customer_key_env"
#: S3 operations that store object data: they carry SSE-S3 / SSE-KMS parameters.
SSE_WRITE_OPERATIONS = frozenset({"put_object", "create_multipart_upload"})
#: S3 operations that touch object data: with SSE-C every one carries the key.
SSE_C_OPERATIONS = frozenset({"put_object", "create_multipart_upload", "upload_part",
                              "complete_multipart_upload", "get_object", "head_object"})


@dataclass
class S3Options(StoreOptions):
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
        part_size: Bytes per multipart-upload part (5 MiB .. 5 GiB) for the first 1,000
            parts of an object; the part size then doubles every 1,000 parts up to 4x
            (S3 allows 10,000 parts: the largest object is 35,000 x part_size, 273 GiB
            at the default 8 MiB). Objects smaller than one part are a single
            ``PutObject``. Small parts keep an upload pipelined (the first part goes out
            while the next is filled, and the last one is short): 8 MiB was as fast as
            32 MiB on SeaweedFS and about 1.5x faster on moto.
        multipart_threshold: Objects of unknown size up to this are stored with a
            single ``PutObject`` (like boto3's ``multipart_threshold``): an upload fills
            one buffer of this size first and starts a multipart upload only when the
            object outgrows it (that buffer becomes part 1, the other parts are
            ``part_size``). An object whose size is announced
            (:meth:`dcpstore.Upload.expect_size`; the writer announces every data file
            of the automatic layout) is one ``PutObject`` up to ``part_size x
            max_concurrency``, sent from a buffer of its size.
            The writer's automatic layout (``files_per_rank=None``) makes data files of
            up to 15/16 of it, so each is one ``PutObject`` on save and one GET on a
            same-world-size load (the framework's ``preferred_object_size``). 16 MiB:
            on moto, which assembles multipart uploads and serves ranged reads by copying
            whole objects, 15 MiB single-request files (4 written at once) saved ~2-3x
            and loaded ~4-6x faster than one multipart file per rank, and faster than
            32 MiB files (2 at once, the same memory); on SeaweedFS they were as fast
            (development runs on a loaded machine). Values below ``part_size`` mean
            ``part_size``; at most 5 GiB.
        max_concurrency: Requests in flight at once per process: upload parts and
            ranged reads. Memory bound of a save: about ``part_size x max_concurrency``
            (parts in flight) plus ``max(multipart_threshold, part_size) x`` the files
            being written at once (each fills its first buffer; a single ``PutObject``
            is sent from the one it filled): ``files_per_rank`` of them when set; with
            the automatic layout as many as their buffers (announced sizes) fit in
            ``part_size x max_concurrency`` (4 files of 15 MiB at the defaults), so the
            whole save stays within ``2 x part_size x max_concurrency`` (128 MiB at the
            defaults). Parts over
            number 1,000 grow up to 4x ``part_size`` (7.8 GiB objects at the default
            part size). Up to ``max_concurrency + 2`` buffers of each size are kept for
            reuse until the backend is closed (``dcpstore.save`` closes it).
        sse: Server-side encryption of the objects written: ``"AES256"`` (SSE-S3,
            S3-managed keys), ``"aws:kms"`` (SSE-KMS) or ``"aws:kms:dsse"`` (DSSE-KMS).
            Default ``None``: the bucket's default encryption. Sent on ``PutObject`` and
            ``CreateMultipartUpload``; reads need nothing (S3 decrypts). See
            ``docs/encryption.md``.
        sse_kms_key_id: The KMS key (id, ARN or ``alias/...``) of ``sse="aws:kms"``;
            default: the bucket's or the AWS-managed ``aws/s3`` key.
        sse_kms_context: SSE-KMS encryption context, a JSON object of strings
            (``{"project": "llm"}``; a ``dict`` as a keyword argument), sent
            base64-encoded.
        sse_bucket_key: S3 Bucket Keys for SSE-KMS (fewer KMS requests); ``None``: the
            bucket's setting.
        sse_customer_key_file: SSE-C: path of a file holding the 256-bit customer key,
            32 raw bytes (``openssl rand 32``) or their base64 (``openssl rand -base64
            32``). The key is sent on every request that touches object data
            (``PutObject``, ``CreateMultipartUpload``, every ``UploadPart``,
            ``CompleteMultipartUpload``, every ``GetObject`` ranged or not,
            ``HeadObject``) and is needed to read the checkpoint back. Only the path is
            an option: the key never is, and it is never logged or shown.
        sse_customer_key_env: SSE-C: name of an environment variable holding the
            base64 of the 256-bit customer key (instead of ``sse_customer_key_file``).
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
    part_size: int = 8 * MiB
    multipart_threshold: int = 16 * MiB
    max_concurrency: int = 8
    sse: str | None = None
    sse_kms_key_id: str | None = None
    sse_kms_context: str | dict[str, str] | None = None
    sse_bucket_key: bool | None = None
    sse_customer_key_file: str | None = None
    sse_customer_key_env: str | None = None

    def validate(self) -> None:
        """Raise :class:`~dcpstore.errors.ConfigurationError` (a ``ValueError``) for values
        S3 would refuse or that make no sense."""
        super().validate()
        if not MIN_PART_SIZE <= self.part_size <= MAX_PART_SIZE:
            raise ConfigurationError(
                f"part_size must be between 5 MiB ({MIN_PART_SIZE}) and 5 GiB "
                f"({MAX_PART_SIZE}) for S3 multipart uploads, got {self.part_size}"
            )
        if not 0 < self.multipart_threshold <= MAX_PART_SIZE:
            raise ConfigurationError(
                f"multipart_threshold must be between 1 byte and 5 GiB ({MAX_PART_SIZE}, "
                f"S3's largest PutObject), got {self.multipart_threshold}"
            )
        if self.addressing_style not in ADDRESSING_STYLES:
            raise ConfigurationError(
                f"addressing_style must be one of {', '.join(ADDRESSING_STYLES)}, "
                f"got {self.addressing_style!r}"
            )
        if self.prefix_strategy not in PREFIX_STRATEGIES:
            raise ConfigurationError(
                f"prefix_strategy must be one of {', '.join(PREFIX_STRATEGIES)}, "
                f"got {self.prefix_strategy!r}"
            )
        if self.connect_timeout <= 0:
            raise ConfigurationError(f"connect_timeout must be > 0, got {self.connect_timeout}")
        if self.endpoint_url is not None:
            parts = urlsplit(self.endpoint_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigurationError(
                    "endpoint_url must be an http:// or https:// URL with a host, e.g. "
                    "http://127.0.0.1:8333"
                )
            if parts.username is not None or parts.password is not None:
                # never echo it: it carries a secret
                raise ConfigurationError(
                    "endpoint_url carries credentials; credentials never belong in a URL. "
                    "Use AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile or a role."
                )
        self._validate_encryption()

    def _validate_encryption(self) -> None:
        """The SSE options: known values, no conflicting ones, a usable customer key."""
        if self.sse is not None and self.sse not in SSE_ALGORITHMS:
            raise ConfigurationError(
                f"sse must be one of {', '.join(SSE_ALGORITHMS)} (SSE-S3, SSE-KMS, "
                f"DSSE-KMS), got {self.sse!r}; for SSE-C set {CUSTOMER_KEY_OPTIONS} instead")
        kms = [name for name in ("sse_kms_key_id", "sse_kms_context", "sse_bucket_key")
               if getattr(self, name) is not None]
        if kms and not (self.sse or "").startswith("aws:kms"):
            raise ConfigurationError(
                f"{', '.join(kms)} apply to SSE-KMS only: set sse='aws:kms' (or "
                f"'aws:kms:dsse') as well, got sse={self.sse!r}")
        if self.sse_kms_context is not None:
            self.kms_context_header()  # raises for a malformed context
        if self.sse_customer_key_file is not None and self.sse_customer_key_env is not None:
            raise ConfigurationError(
                "set only one of sse_customer_key_file and sse_customer_key_env (both "
                "name the SSE-C customer key)")
        if self.customer_key_configured:
            if self.sse is not None:
                raise ConfigurationError(
                    f"an SSE-C customer key ({CUSTOMER_KEY_OPTIONS}) excludes sse="
                    f"{self.sse!r}: S3 encrypts an object one way; unset one of them")
            load_customer_key(self.sse_customer_key_file, self.sse_customer_key_env)

    @property
    def customer_key_configured(self) -> bool:
        """Whether an SSE-C customer key is configured (file or environment variable)."""
        return self.sse_customer_key_file is not None or self.sse_customer_key_env is not None

    def kms_context_header(self) -> str | None:
        """``sse_kms_context`` as S3 takes it: the base64 of its JSON."""
        context: Any = self.sse_kms_context
        if context is None:
            return None
        if isinstance(context, str):
            try:
                context = json.loads(context)
            except ValueError:
                context = None
        if not isinstance(context, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in context.items()):
            raise ConfigurationError(
                "sse_kms_context must be a JSON object of strings, e.g. "
                "'{\"project\": \"llm\"}' (or a dict of strings as a keyword argument)")
        return base64.b64encode(json.dumps(context, sort_keys=True).encode()).decode("ascii")


def load_customer_key(path: str | None, env: str | None) -> bytes:
    """The 32-byte SSE-C key from the file at ``path`` (raw or base64) or from the
    environment variable named ``env`` (base64); see
    :func:`dcpstore.plugin.load_customer_key`."""
    return _load_key(path=path, env=env, file_option="sse_customer_key_file",
                     env_option="sse_customer_key_env")


def encryption_params(options: S3Options) -> tuple[dict[str, Any], dict[str, Any]]:
    """The SSE request parameters of ``options``: ``(on writes, with SSE-C on every
    request touching object data)``. The SSE-C key travels base64-encoded with its MD5
    (computed once here, so botocore's per-request MD5 handler stands aside)."""
    write: dict[str, Any] = {}
    if options.sse is not None:
        write["ServerSideEncryption"] = options.sse
        if options.sse_kms_key_id is not None:
            write["SSEKMSKeyId"] = options.sse_kms_key_id
        context = options.kms_context_header()
        if context is not None:
            write["SSEKMSEncryptionContext"] = context
        if options.sse_bucket_key is not None:
            write["BucketKeyEnabled"] = options.sse_bucket_key
    customer: dict[str, Any] = {}
    if options.customer_key_configured:
        key = load_customer_key(options.sse_customer_key_file, options.sse_customer_key_env)
        digest = hashlib.md5(key, usedforsecurity=False).digest()
        customer = {
            "SSECustomerAlgorithm": "AES256",
            "SSECustomerKey": base64.b64encode(key).decode("ascii"),
            "SSECustomerKeyMD5": base64.b64encode(digest).decode("ascii"),
        }
    return write, customer
