"""The step's secret and the keys derived from it (see the package docstring)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping

SECRET_ENV = "BV_JOB_SECRET"
MAC_HEX = 32  # 128 bits of HMAC-SHA256, hex


def new_secret() -> str:
    return secrets.token_hex(32)


def secret_from_env(env: Mapping[str, str] | None = None) -> bytes | None:
    """The step's secret from ``BV_JOB_SECRET`` (64 hex digits), or None."""
    value = (os.environ if env is None else env).get(SECRET_ENV, "")
    if len(value) != 64:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None


def derive(secret: bytes, purpose: bytes) -> bytes:
    return hmac.new(secret, b"bv-" + purpose, hashlib.sha256).digest()


def line_key(secret: bytes) -> bytes:
    """The key of the agents' line channel (`channel.Channel`)."""
    return derive(secret, b"line")


def beat_key(secret: bytes) -> bytes:
    """The key of the ranks' datagrams (`messages`: heartbeats and checkpoints)."""
    return derive(secret, b"beat")


def agg_key(secret: bytes) -> bytes:
    """The key of the node agents' aggregates of their ranks' beats (`messages.Agg`)."""
    return derive(secret, b"agg")


def mac(key: bytes, data: bytes) -> bytes:
    # hmac.digest: the one-shot C path (a third of hmac.new's cost per beat).
    return hmac.digest(key, data, "sha256").hex()[:MAC_HEX].encode()
