"""How every client talks to the stores: request settings, TLS trust and MSC profiles
(a leaf module, shared by the systems, the limits, the stores and the wire checks).

**Equal request settings.** Every botocore-based client (dcpstore-s3, dcpstore-msc,
``torch-fsspec-s3`` through s3fs/aiobotocore, ``msc``, ``limit-s3``) is configured the
same way, :data:`BOTOCORE_S3_CONFIG`: ``payload_signing_enabled=False``
(``UNSIGNED-PAYLOAD``, which botocore's S3 signer obeys over plain HTTP too when it is
set explicitly) and ``request_checksum_calculation`` / ``response_checksum_validation``
= ``"when_required"`` (no per-request CRC trailers, no response checksum validation).
s3torchconnector's CRT client exposes neither setting (:data:`CRT_SETTINGS`).
``python -m benchmarks.wire_settings`` checks on the wire that they hold.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = [
    "BOTOCORE_S3_CONFIG",
    "BOTOCORE_SETTINGS",
    "CRT_SETTINGS",
    "TLS_TRUST",
    "botocore_path_config",
    "msc_part_profile",
    "msc_profile",
]

#: The request settings every botocore-based system gets (see the module docstring).
BOTOCORE_S3_CONFIG: dict[str, Any] = {
    "s3": {"payload_signing_enabled": False},
    "request_checksum_calculation": "when_required",
    "response_checksum_validation": "when_required",
}
#: How :data:`BOTOCORE_S3_CONFIG` reads in the report.
BOTOCORE_SETTINGS: dict[str, str] = {
    "payload": "UNSIGNED-PAYLOAD (payload_signing_enabled=False)",
    "request checksums": "when_required (none on PUT/UploadPart)",
    "response checksums": "when_required (not validated)",
}
#: s3torchconnector's CRT client (mountpoint-s3-client) has no knob for either: what it
#: does by default, as ``python -m benchmarks.wire_settings`` sees it on the wire.
CRT_SETTINGS: dict[str, str] = {
    "payload": "UNSIGNED-PAYLOAD (CRT default, not configurable)",
    "request checksums": "none (CRT default, not configurable)",
    "response checksums": "not requested (CRT default, not configurable)",
}
#: How the ``--tls`` CA reaches each client stack (``System.tls_trust``).
TLS_TRUST: dict[str, str] = {
    "botocore": "AWS_CA_BUNDLE (botocore)",
    "aiobotocore": "AWS_CA_BUNDLE (aiobotocore, under s3fs)",
    "msc": "AWS_CA_BUNDLE (MSC's boto3 client)",
    "crt": "SSL_CERT_FILE (the CRT's default trust store)",
    "aiohttp": "SSL_CERT_FILE (aiohttp's default SSL context)",
}


def botocore_path_config(**extra: Any) -> Any:
    """A botocore ``Config`` with :data:`BOTOCORE_S3_CONFIG` and path-style addressing
    (the stand-ins' buckets are not DNS names), plus ``extra`` (pools, retries,
    timeouts): what the raw boto3 clients of the limits and of ``request_cost`` use."""
    from botocore.config import Config

    settings = dict(BOTOCORE_S3_CONFIG)
    settings["s3"] = {**BOTOCORE_S3_CONFIG["s3"], "addressing_style": "path"}
    return Config(**settings, **extra)


def msc_part_profile(profile: str, part_size: int) -> str:
    """The MSC profile of ``profile``'s server with ``part_size`` parts."""
    return f"{profile}-part{part_size}"


def msc_profile(endpoint: str, region: str, bucket: str, *, part_size: int | None = None
                ) -> dict[str, Any]:
    """An MSC S3 profile of ``bucket`` at ``endpoint`` (with ``part_size``: that
    ``multipart_threshold`` and ``multipart_chunksize``). No credentials_provider: MSC's
    S3 provider takes the same ``AWS_*`` environment as every other client; the request
    settings are every botocore client's."""
    options: dict[str, Any] = {"base_path": bucket, "endpoint_url": endpoint,
                               "region_name": region, **copy.deepcopy(BOTOCORE_S3_CONFIG)}
    if part_size is not None:
        options.update(multipart_threshold=part_size, multipart_chunksize=part_size)
    return {"storage_provider": {"type": "s3", "options": options}}
