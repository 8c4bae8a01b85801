"""Who owns a stored row (the tenant) and what it is called (its id): both decided by the router, never by a client."""

from __future__ import annotations

import hashlib
import secrets

ANONYMOUS = "anonymous"  # the one tenant of a router with no API key configured
ID_PREFIXES = ("resp", "conv", "msg")


def tenant_of(api_key: str | None) -> str:
    """The tenant a request's API key stands for: its sha256 (the key itself is never stored), or ANONYMOUS without
    one. 64 hex digits can never read as ANONYMOUS."""
    if not api_key:
        return ANONYMOUS
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_id(prefix: str) -> str:
    """`resp_`, `conv_` or `msg_` and 48 random hex digits, OpenAI's shape: unguessable, so an id is no handle on
    another tenant's rows even before the tenant check."""
    if prefix not in ID_PREFIXES:
        raise ValueError(f"unknown id prefix {prefix!r}; known: {', '.join(ID_PREFIXES)}")
    return f"{prefix}_{secrets.token_hex(24)}"
