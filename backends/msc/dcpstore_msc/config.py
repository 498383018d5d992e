"""MSC configuration: the plugin's options and errors, and resolving a URL to a client.

A URL resolves as MSC resolves it: ``msc://profile/path`` through the profiles of the
configuration (the ``config`` option, else MSC's own lookup: ``MSC_CONFIG``, its search
paths, rclone configs); any other URL or path (the feature flag) through the config's
``path_mapping`` first, then MSC's implicit profiles (``_s3-<bucket>``,
``__filesystem__``). The plugin builds the client from that config itself, with the
profile's ``retry`` attempts set to one (and the SDK's own retries inside S3-type and
Azure providers): dcpstore retries every request (``max_attempts``), and MSC retrying
inside each attempt would multiply the requests. A profile that sets retries itself is
overridden too, and an INFO line says so.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from dcpstore.plugin import BucketNotFoundError, ConfigurationError, StoreOptions

__all__ = [
    "MSCConfigError",
    "MSCOptions",
    "ProfileNotFoundError",
    "StorageNotFoundError",
    "resolve_url",
]

MSC_SCHEME = "msc"

logger = logging.getLogger(__name__)


@dataclass
class MSCOptions(StoreOptions):
    """Options of the MSC backend (also ``DCPSTORE_MSC_<OPTION>`` variables, URI query).

    Attributes:
        config: The MSC configuration: a dict (as in ``msc_config.yaml``) or the path of
            a YAML/JSON config file. Default: MSC's own lookup (``MSC_CONFIG``, then its
            search paths).
        part_size: Objects up to this size are uploaded from memory in one request;
            larger ones are spooled to a temporary file and uploaded by MSC.
        spool_dir: Directory of the temporary spool files (default: the system's).
        fsync: On POSIX profiles, ``fsync`` data files before they are renamed into place.
        max_attempts: Attempts per request (dcpstore's retries; the profile's own
            ``retry`` attempts, and botocore's or the Azure SDK's inside its provider,
            are set to one, even where the profile sets them, so they do not multiply).
        read_chunk: Largest single ``read`` request. MSC returns each ranged read as a
            whole ``bytes`` object, so a range the reader asks for longer than this is
            fetched as consecutive requests of at most this many bytes, each copied
            straight into its destination buffers: the transient memory per range in
            flight is one chunk. The default is the reader's largest range (64 MiB),
            so each range is one request (16 MiB made 3x the GETs and loaded at 0.47x
            on moto, which copies an object per ranged GET); a lower value trades
            requests for memory. POSIX profiles read with ``preadv`` straight into the
            destinations and ignore it.
    """

    # a config dict may hold credentials (credentials_provider options): never shown
    config: dict[str, Any] | str | None = field(default=None, repr=False)
    spool_dir: str | None = None
    fsync: bool = True
    part_size: int = 64 * 1024 * 1024
    read_chunk: int = 64 * 1024 * 1024

    def validate(self) -> None:
        """Raise ``ValueError`` (a :class:`ConfigurationError`) for values that make no
        sense."""
        super().validate()
        if self.read_chunk < 1:
            raise ConfigurationError(f"read_chunk must be > 0, got {self.read_chunk}")


class MSCConfigError(ConfigurationError):
    """The MSC configuration is missing, unreadable or invalid."""


class ProfileNotFoundError(MSCConfigError, LookupError):
    """An ``msc://`` URI names a profile the MSC configuration does not define."""


#: The bucket / container behind an MSC profile does not exist: the error every backend
#: raises for a missing bucket (kept under its old name).
StorageNotFoundError = BucketNotFoundError


def resolve_url(url: str, explicit: dict[str, Any] | str | None) -> tuple[Any, str, str]:
    """The MSC ``StorageClient`` serving ``url``, its profile and the root path in it.

    Raises:
        MSCConfigError: No configuration, an invalid one, or a URL MSC cannot serve.
        ProfileNotFoundError: ``msc://`` names a profile the configuration lacks.
    """
    config, source = _load_config(explicit)
    if url.startswith(f"{MSC_SCHEME}://"):
        profile, path = _split_msc_url(url)
        _check_profile(url, profile, config, source)
        config = _with_implicit(config, profile)
    else:
        profile, path, config = _map_url(url, config)
    _check_endpoint(config, profile)
    return _client_for(config, profile), profile, _root(path)


# -- the configuration --------------------------------------------------------------------


def _load_config(config: dict[str, Any] | str | None) -> tuple[dict[str, Any], str]:
    """The MSC config dict (with rclone's profiles where MSC's lookup is used) and where
    it came from (``""`` when none was found)."""
    from multistorageclient.config import StorageClientConfig

    if isinstance(config, dict):
        return config, "the config option"
    paths = [config] if isinstance(config, str) and config else None
    if paths and not os.path.isfile(paths[0]):
        raise MSCConfigError(f"MSC config file {paths[0]!r} (config option) does not exist")
    try:
        found, path = StorageClientConfig.read_msc_config(config_file_paths=paths)
    except Exception as exc:
        raise MSCConfigError(f"invalid MSC configuration: {exc}") from exc
    merged = dict(found or {})
    rclone = _rclone_profiles()
    if rclone and paths is None:  # as MSC's own lookup does
        merged["profiles"] = {**rclone, **dict(merged.get("profiles") or {})}
    return merged, path or ""


def _rclone_profiles() -> dict[str, Any]:
    try:
        from multistorageclient.rclone import read_rclone_config

        found, _ = read_rclone_config()
    except Exception:
        return {}
    return dict((found or {}).get("profiles", {}))


def _search_paths() -> list[str]:
    from multistorageclient import config as msc_config

    paths = []
    if os.environ.get("MSC_CONFIG"):
        paths.append(f"$MSC_CONFIG={os.environ['MSC_CONFIG']}")
    paths += list(msc_config._find_config_file_paths())
    return paths


def _split_msc_url(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    path = "/".join(s for s in parts.path.split("/") if s)
    return parts.netloc, path


def _check_profile(url: str, profile: str, config: dict[str, Any], source: str) -> None:
    from multistorageclient.config import RESERVED_POSIX_PROFILE_NAME

    if not profile:
        raise MSCConfigError(f"{url} names no profile: use msc://profile/path")
    profiles = dict(config.get("profiles") or {})
    if profile in profiles or profile == RESERVED_POSIX_PROFILE_NAME or (
        profile.startswith("_") and "-" in profile
    ):
        return
    if not source:
        raise MSCConfigError(
            f"no MSC configuration found for {url}: set MSC_CONFIG to a config file, pass "
            "config={...} (or config='path/to/msc_config.yaml'), or create one of: "
            f"{', '.join(_search_paths())}"
        )
    known = ", ".join(sorted(profiles)) or "(none)"
    raise ProfileNotFoundError(
        f"MSC profile {profile!r} is not defined in {source}; known profiles: {known}"
    )


def _with_implicit(config: dict[str, Any], profile: str) -> dict[str, Any]:
    """``config`` with the implicit profile ``profile`` (``__filesystem__``,
    ``_s3-<bucket>``) added where it does not define it."""
    from multistorageclient.config import (
        RESERVED_POSIX_PROFILE_NAME,
        SUPPORTED_IMPLICIT_PROFILE_PROTOCOLS,
        create_implicit_profile_config,
    )

    if profile in (config.get("profiles") or {}):
        return config
    if profile == RESERVED_POSIX_PROFILE_NAME:
        protocol, base = "file", "/"
    else:
        protocol, _, base = profile[1:].partition("-")
        if protocol not in SUPPORTED_IMPLICIT_PROFILE_PROTOCOLS:
            raise MSCConfigError(
                f"MSC profile {profile!r} is not defined and {protocol}:// has no implicit "
                f"profile (MSC supports "
                f"{', '.join(p + '://' for p in SUPPORTED_IMPLICIT_PROFILE_PROTOCOLS)})")
    merged = copy.deepcopy(config)
    merged.setdefault("profiles", {}).update(
        create_implicit_profile_config(profile, protocol, base)["profiles"])
    return merged


def _map_url(url: str, config: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """Resolve a non-msc URL as MSC does: ``path_mapping`` first, then implicit
    profiles."""
    from multistorageclient.config import (
        RESERVED_POSIX_PROFILE_NAME,
        SUPPORTED_IMPLICIT_PROFILE_PROTOCOLS,
        PathMapping,
    )

    found = PathMapping.from_config(config).find_mapping(url)
    if found is not None:
        return found[0], found[1], _with_implicit(config, found[0])
    parts = urlsplit(url)
    protocol = parts.scheme.lower() if "://" in url else "file"
    if protocol == "file":
        profile, path = RESERVED_POSIX_PROFILE_NAME, parts.path or url
    elif protocol not in SUPPORTED_IMPLICIT_PROFILE_PROTOCOLS:
        raise MSCConfigError(
            f"MSC cannot serve {url}: no path_mapping entry matches it and {protocol}:// "
            f"has no implicit profile (MSC supports "
            f"{', '.join(p + '://' for p in SUPPORTED_IMPLICIT_PROFILE_PROTOCOLS)})"
        )
    else:
        profile, path = f"_{protocol}-{parts.netloc}", parts.path.lstrip("/")
    return profile, path, _with_implicit(config, profile)


def _check_endpoint(config: dict[str, Any], profile: str) -> None:
    """Refuse a profile whose endpoint URL carries ``user:password@`` (never echoed: the
    client libraries would print it in their logs and errors)."""
    endpoint: Any = config.get("profiles") or {}
    for name in (profile, "storage_provider", "options", "endpoint_url"):
        endpoint = endpoint.get(name) if isinstance(endpoint, dict) else None
    if isinstance(endpoint, str) and "@" in urlsplit(endpoint).netloc:
        raise MSCConfigError(
            f"the endpoint_url of MSC profile {profile!r} carries credentials; credentials "
            "never belong in a URL: put them in the profile's credentials_provider"
        )


#: Storage providers built on botocore, whose own retries MSC passes through as the
#: provider option ``retries`` (a ``botocore.config.Config`` setting).
_BOTOCORE_PROVIDERS = frozenset({"s3", "s8k", "gcs_s3", "ais_s3"})
#: The Azure SDK's retry options, which MSC's ``azure`` provider passes to its client.
_AZURE_RETRY_OPTIONS = ("retry_total", "retry_connect", "retry_read", "retry_status")
_ONE_BOTOCORE_ATTEMPT = {"total_max_attempts": 1}


def _one_attempt(config: dict[str, Any], profile: str) -> tuple[dict[str, Any], list[str]]:
    """``config`` with ``profile``'s MSC ``retry`` attempts set to one, and the SDK's own
    retries inside its provider too (botocore's for S3-type providers, the Azure SDK's
    for ``azure``): dcpstore retries each request itself, and retries in three layers
    would multiply the requests.

    Returns:
        The new config, and what the profile itself had set that was overridden (empty
        when it set nothing, or one attempt already).
    """
    merged = copy.deepcopy(config)
    overridden: list[str] = []
    entry = merged.get("profiles", {}).get(profile)
    if not isinstance(entry, dict):
        return merged, overridden
    retry = entry.get("retry")
    if isinstance(retry, dict) and retry.get("attempts", 1) != 1:
        overridden.append(f"retry attempts {retry['attempts']}")
    entry["retry"] = {**(retry if isinstance(retry, dict) else {}), "attempts": 1}
    provider = entry.get("storage_provider")
    if not isinstance(provider, dict):
        return merged, overridden
    options = provider.setdefault("options", {})
    if not isinstance(options, dict):
        return merged, overridden
    kind = provider.get("type")
    if kind in _BOTOCORE_PROVIDERS:
        if options.get("retries", _ONE_BOTOCORE_ATTEMPT) != _ONE_BOTOCORE_ATTEMPT:
            overridden.append(f"retries {options['retries']}")
        options["retries"] = dict(_ONE_BOTOCORE_ATTEMPT)
    elif kind == "azure":
        overridden += [f"{name} {options[name]}" for name in _AZURE_RETRY_OPTIONS
                       if options.get(name, 0) != 0]
        for name in _AZURE_RETRY_OPTIONS[1:]:
            options.pop(name, None)
        options["retry_total"] = 0  # the first attempt only
    return merged, overridden


_CLIENTS: dict[tuple[int, str, str], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _client_for(config: dict[str, Any], profile: str) -> Any:
    """An MSC StorageClient for ``profile`` of ``config`` (cached per process)."""
    from multistorageclient import StorageClient, StorageClientConfig
    from multistorageclient.config import RESERVED_POSIX_PROFILE_NAME

    overridden: list[str] = []
    if profile != RESERVED_POSIX_PROFILE_NAME:  # MSC refuses to change that one
        config, overridden = _one_attempt(config, profile)
    key = (os.getpid(), json.dumps(config, sort_keys=True, default=str), profile)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            implicit = profile == RESERVED_POSIX_PROFILE_NAME or profile.startswith("_")
            try:  # MSC validates implicit profiles' configs when it reads the file
                cfg = StorageClientConfig.from_dict(config, profile=profile,
                                                    skip_validation=implicit)
            except Exception as exc:
                raise MSCConfigError(f"MSC profile {profile!r} is invalid: {exc}") from exc
            client = StorageClient(cfg)
            _CLIENTS[key] = client
            if overridden:
                logger.info(
                    "MSC profile %r sets %s: dcpstore retries every request itself (its "
                    "max_attempts option, DCPSTORE_MSC_MAX_ATTEMPTS), so the profile's "
                    "retries are set to one attempt; raise max_attempts to retry more",
                    profile, ", ".join(overridden))
        return client


def _root(path: str) -> str:
    path = path.rstrip("/")
    return path if path.startswith("/") else path.strip("/")
