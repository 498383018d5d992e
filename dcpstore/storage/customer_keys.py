"""A customer-supplied encryption key (S3 SSE-C, GCS CSEK), read from where its options
say, never from the URI: the plugin toolkit's one copy (:mod:`dcpstore.plugin`).

A key is 256 bits: a file holds 32 raw bytes or their base64; an environment variable
holds the base64. Messages name the option and the path or variable, never the key.
"""

from __future__ import annotations

import base64
import binascii
import os

from dcpstore.errors import ConfigurationError

__all__ = ["load_customer_key"]

#: Bytes of an AES-256 key.
KEY_BYTES = 32


def load_customer_key(*, path: str | None, env: str | None, file_option: str,
                      env_option: str) -> bytes:
    """The 32-byte key from the file at ``path`` (raw or base64) or from the environment
    variable named ``env`` (base64).

    Args:
        path: The key file (the ``file_option``'s value), or ``None``.
        env: The variable's name (the ``env_option``'s value), or ``None``.
        file_option: The option that names the file (in messages).
        env_option: The option that names the variable (in messages).

    Raises:
        ConfigurationError: Neither is set, the file or variable is missing, or it does
            not hold 32 bytes.
    """
    if path is not None:
        where = f"{file_option}={path!r}"
        try:
            with open(os.path.expanduser(path), "rb") as f:
                raw = f.read(4096)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot read the customer encryption key: {where}: "
                f"{exc.strerror or exc}") from None
        if len(raw) == KEY_BYTES:
            return raw
        text = raw.strip()
    elif env is not None:
        where = f"{env_option}={env!r}"
        value = os.environ.get(env)
        if value is None:
            raise ConfigurationError(
                f"{where}: the environment variable {env} is not set; set it to the "
                "base64 of the 32-byte key (e.g. `openssl rand -base64 32`)")
        text = value.strip().encode("ascii", "replace")
    else:
        raise ConfigurationError(
            f"no customer encryption key configured ({file_option} or {env_option})")
    try:
        key = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise ConfigurationError(
            f"{where} must hold a 256-bit (32-byte) AES key, as 32 raw bytes (file only) or "
            "their base64 (44 characters, e.g. `openssl rand -base64 32`); it does not")
    return key
