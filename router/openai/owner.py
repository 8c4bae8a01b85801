"""Who owns a stored response: the one function that says it for every route (router/openai/responses_api.py and
responses_routes.py), so that tenants can be put in its place. A caller reads, chains and deletes only its own
objects; another owner's are not found (404), as absent ones."""

from __future__ import annotations

from collections.abc import Mapping

from router.store import tenant_of


def owner_of(headers: Mapping[str, str]) -> str:
    """The caller's owner string: the sha256 (hex) of its bearer token, or "anonymous" without one. `headers`: the
    request's, lower-cased names (the edge's) or case-insensitive (FastAPI's)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return tenant_of(token.strip() if scheme.lower() == "bearer" else None)
