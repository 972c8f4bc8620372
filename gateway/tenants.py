"""Tenants: who a `/v1/` call is from, read from its API key, and the `cache_salt` its calls
are cached under.

Without tenants in the config the gateway serves one trust domain, as vLLM does: a client's
own `cache_salt` is the only thing that keeps its prefixes apart. With tenants, every `/v1/`
call needs `Authorization: Bearer KEY`. A tenant's key makes the call that tenant's: its
`cache_salt` is set by the gateway (whatever the client sent), its workflows are its own
(others get a 404), and hint-mode calls can join only its own workflows. The admin key is
the operator's: it reads and cancels every tenant's workflows and reads the traces, and
makes no calls.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, replace

from aiohttp import web

from gateway.config import TenantEntry
from gateway.errors import GatewayError
from planner.hints import RequestHints


class NotAuthenticated(GatewayError):
    """A `/v1/` call without a key this gateway knows."""

    status = 401
    err_type = "authentication_error"
    code = "invalid_api_key"


class NotPermitted(GatewayError):
    """A key that may not do this (a tenant's key on the operator's endpoints, or the
    reverse)."""

    status = 403
    err_type = "permission_error"
    code = "not_permitted"


@dataclass(frozen=True)
class Tenant:
    """Whom a call is from."""

    name: str
    salt: str | None
    """The `cache_salt` its calls carry; None for the operator (who makes no calls)."""
    priority_floor: int = 0
    """`TenantEntry.priority_floor`."""
    min_deadline_s: float | None = None
    """`TenantEntry.min_deadline_s` (None: its deadlines rank nothing)."""

    def clamp(self, hints: RequestHints) -> tuple[RequestHints, list[str]]:
        """Its call's hints with the priority and deadline it may ask, and the names of the
        hints that were changed."""
        priority, deadline = hints.priority, hints.deadline_s
        changed = []
        floor = self.priority_floor
        if priority is not None and priority < floor:
            priority = floor
            changed.append("priority")
        elif priority is None and floor > 0:
            priority = floor  # no priority is vLLM's 0: held behind it unasked (not counted)
        if deadline is not None and (self.min_deadline_s is None
                                     or deadline < self.min_deadline_s):
            deadline = self.min_deadline_s
            changed.append("deadline_s")
        if priority == hints.priority and deadline == hints.deadline_s:
            return hints, changed
        return replace(hints, priority=priority, deadline_s=deadline), changed

    @property
    def operator(self) -> bool:
        return self.salt is None

    def may_see(self, owner: object) -> bool:
        """Whether it may read a workflow owned by `owner` (the workflow's `tenant`)."""
        return self.operator or owner == self.name


OPERATOR = Tenant("(operator)", None)
TENANT_KEY = web.RequestKey("tenant", Tenant)


def bearer(headers: Mapping[str, str]) -> str | None:
    """The key of an `Authorization: Bearer KEY` header (the scheme in any case), else None."""
    value = headers.get("Authorization")
    if value is None:
        return None
    scheme, _, key = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None


class Tenancy:
    """The configured tenants, looked up by a digest of their keys."""

    def __init__(self, tenants: Mapping[str, TenantEntry], admin_key: str | None) -> None:
        self._by_digest: dict[bytes, Tenant] = {}
        for name, entry in tenants.items():
            tenant = Tenant(name, f"kvgate-tenant:{entry.prefix_group or name}",
                            entry.priority_floor, entry.min_deadline_s)
            for key in entry.keys:
                self._by_digest[_digest(key)] = tenant
        self._admin = _digest(admin_key) if admin_key else None

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    def resolve(self, headers: Mapping[str, str]) -> Tenant:
        """Whom the request is from; NotAuthenticated naming what is missing."""
        key = bearer(headers)
        if key is None:
            raise NotAuthenticated("this gateway serves tenants: send your key as "
                                   "Authorization: Bearer KEY")
        digest = _digest(key)
        if self._admin is not None and hmac.compare_digest(digest, self._admin):
            return OPERATOR
        tenant = self._by_digest.get(digest)
        if tenant is None:
            raise NotAuthenticated("the key is not one of this gateway's")
        return tenant


def salt_label(salt: str) -> str:
    """What a workflow record shows for a client's own `cache_salt` (no tenants configured,
    where every record is readable): equal salts, equal labels, and not the salt, which would
    let any reader share that client's cache."""
    return "salt:" + hashlib.sha256(salt.encode()).hexdigest()[:16]


def _digest(key: str) -> bytes:
    # Keys are looked up by digest, so neither a dict probe nor a comparison runs over them.
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def caller(request: web.Request) -> Tenant | None:
    """The tenant the middleware found for the request (None without tenants)."""
    return request.get(TENANT_KEY)
