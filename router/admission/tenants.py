"""Tenants: who a request is for, by its API key, and whether the tenant's quotas let it in.

Each key names a tenant (router/config.py's TenantConfig, and `tenants_file`, a YAML mapping of more: a Kubernetes
Secret mounted as a file). Keys are kept as their sha256 hex digests only: a request's bearer is hashed and compared
with every digest in constant time (hmac.compare_digest), and neither the key nor its digest is ever logged. A tenant
has a priority class (router/admission/gate.py queues by it; it becomes SGLang's `priority` on both halves where both
workers run priority scheduling: `priority_for`) and quotas: requests per second and prompt tokens per minute (token
buckets: a burst of one second's requests, of one minute's tokens), and concurrent requests. A request over a quota
gets a 429 with Retry-After at once; the other tenants are not slowed.

With no tenants: the single-tenant case, as before (the shared `api_key`, if any; router/service.py checks it), with
no quotas, in the default class. `tenant_of` names the owner of a request either way (the Responses API's store keys
its objects by it): the tenant's name; with no tenants, the bearer's sha256, or "anonymous" without one.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import math
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import TypeAdapter

from pdcluster.common.http import ApiError, Incoming
from router.admission.gate import DEFAULT_CLASS, Refused
from router.config import RouterConfig, TenantConfig, check_tenants
from router.fleet.workers import Worker
from router.metrics import CURRENT_TENANT, RouterMetrics
from router.store import tenant_of as key_owner

# The tenant a request was admitted as: its class's priority, for its attempts (`priority_for`).
CURRENT_PRIORITY: ContextVar[int | None] = ContextVar("tenant_priority", default=None)


def bearer(request: Incoming) -> str | None:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return given.strip() or None if scheme.lower() == "bearer" else None


@dataclass
class Bucket:
    """A token bucket: `rate` per second, at most `size` held."""

    rate: float
    size: float
    level: float = -1.0  # full at the first look
    at: float = 0.0

    def wait(self, amount: float, now: float) -> float:
        """Seconds until `amount` (at most the size) could be taken; 0: now."""
        self.level = self.size if self.level < 0 else min(self.size, self.level + (now - self.at) * self.rate)
        self.at = now
        return max(0.0, (min(amount, self.size) - self.level) / self.rate)

    def take(self, amount: float) -> None:
        self.level -= min(amount, self.size)


@dataclass
class Tenant:
    name: str
    config: TenantConfig
    in_flight: int = 0
    requests: Bucket | None = None
    tokens: Bucket | None = None
    digests: list[bytes] = field(default_factory=list)

    @classmethod
    def of(cls, name: str, config: TenantConfig) -> Tenant:
        rps, tpm = config.requests_per_second, config.tokens_per_minute
        return cls(name, config, requests=Bucket(rps, max(1.0, rps)) if rps else None,
                   tokens=Bucket(tpm / 60.0, float(tpm)) if tpm else None,
                   digests=[bytes.fromhex(d) for d in config.key_sha256])


def load_tenants(config: RouterConfig) -> dict[str, TenantConfig]:
    """The config's tenants and its tenants_file's (ValueError for a file that names one twice, or is invalid)."""
    tenants = dict(config.tenants)
    if config.tenants_file:
        loaded = yaml.safe_load(Path(config.tenants_file).read_text(encoding="utf-8")) or {}
        for name, tenant in TypeAdapter(dict[str, TenantConfig]).validate_python(loaded).items():
            if name in tenants:
                raise ValueError(f"tenants_file: tenant {name} is in the router config too")
            tenants[name] = tenant
        check_tenants(tenants, config.admission)
    return tenants


class Tenancy:
    """The tenants of one router (the module's docstring)."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, clock=time.monotonic):
        self.config, self.metrics, self.clock = config, metrics, clock
        self.tenants = {name: Tenant.of(name, t) for name, t in load_tenants(config).items()}

    def authenticate(self, request: Incoming) -> Tenant | None:
        """The request's tenant (401 if its key names none); None with no tenants."""
        if not self.tenants:
            return None
        given = bearer(request)
        presented = hashlib.sha256(given.encode()).digest() if given else b"\0" * 32
        found = None
        for tenant in self.tenants.values():  # every digest compared: the time says nothing of which matched
            for stored in tenant.digests:
                if hmac.compare_digest(presented, stored) and given:
                    found = tenant
        if found is None:
            raise ApiError(401, "missing or unknown API key")
        CURRENT_TENANT.set(found.name)
        return found

    def tenant_of(self, request: Incoming) -> str:
        """Who the request is for (the module's docstring); 401 with tenants and no known key."""
        tenant = self.authenticate(request)
        if tenant is not None:
            return tenant.name
        return key_owner(bearer(request))

    def priority_class(self, tenant: Tenant | None) -> str:
        return tenant.config.priority_class if tenant is not None else DEFAULT_CLASS

    @contextlib.contextmanager
    def within_quota(self, tenant: Tenant | None, tokens: int) -> Iterator[None]:
        """Within it the request counts against its tenant's quotas; Refused (a 429) if it is over one."""
        klass = self.priority_class(tenant)
        CURRENT_PRIORITY.set(self.config.admission.classes[klass].priority)
        if tenant is None:
            yield
            return
        self._admit(tenant, klass, tokens)
        tenant.in_flight += 1
        self.metrics.tenant_tokens.labels(tenant.name).inc(tokens)
        try:
            yield
        finally:
            tenant.in_flight -= 1

    def _admit(self, tenant: Tenant, klass: str, tokens: int) -> None:
        config, now = tenant.config, self.clock()
        if config.concurrent_requests is not None and tenant.in_flight >= config.concurrent_requests:
            raise self._refused(tenant, klass, "concurrent_requests", 1.0,
                                f"{config.concurrent_requests} concurrent requests")
        waits = {"requests_per_second": tenant.requests.wait(1, now) if tenant.requests else 0.0,
                 "tokens_per_minute": tenant.tokens.wait(tokens, now) if tenant.tokens else 0.0}
        reason, wait = max(waits.items(), key=lambda item: item[1])
        if wait > 0:
            quota = getattr(config, reason)
            raise self._refused(tenant, klass, reason, wait, f"{quota:g} {reason.replace('_', ' ')}")
        if tenant.requests:
            tenant.requests.take(1)
        if tenant.tokens:
            tenant.tokens.take(tokens)

    def _refused(self, tenant: Tenant, klass: str, reason: str, wait: float, quota: str) -> Refused:
        self.metrics.tenant_refusals.labels(tenant.name, reason).inc()
        retry = max(1, math.ceil(wait))
        return Refused(f"tenant {tenant.name} is over its quota of {quota}; retry after {retry}s", retry, reason)


def priority_for(body: dict, prefill: Worker, decode: Worker) -> None:
    """SGLang's `priority` in the body: the request's class's, where both workers run priority scheduling (elsewhere
    SGLang may refuse it); none else (a client never chooses its own: the checks refuse the field)."""
    priority = CURRENT_PRIORITY.get()
    if priority is not None and all(w.capabilities.priority_scheduling for w in (prefill, decode)):
        body["priority"] = priority
    else:
        body.pop("priority", None)
