"""API keys, tenants and the prefix-cache namespace a request runs in.

Tenant isolation against the prefix-cache timing side channel: the namespace is derived on the
server from the *authenticated* tenant, never from a client field. A client ``cache_salt`` may only
narrow sharing further inside that tenant: namespace = (tenant, cache_salt), so two tenants can never
end up in the same namespace whatever salts they send.

Without configured keys the server is open (one anonymous tenant); ``cache_salt`` still splits it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from radixkv.server.errors import APIError, unauthorized

# The namespace handed to the engine / cache: None (shared, no keys, no salt) or a tuple of strings.
Namespace = tuple[str, ...] | None

ANONYMOUS = ""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def load_api_keys(path: str | Path) -> dict[str, str]:
    """Read a JSON object mapping API key -> tenant name; ValueError names what is wrong."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read API key file {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"API key file {path} is not valid JSON: {e}") from None
    return validate_api_keys(raw)


def validate_api_keys(raw: object) -> dict[str, str]:
    if not isinstance(raw, dict) or not raw:
        raise ValueError("API keys must be a non-empty JSON object mapping key -> tenant name")
    out: dict[str, str] = {}
    for key, tenant in raw.items():
        if not isinstance(key, str) or len(key) < 8:
            raise ValueError("every API key must be a string of at least 8 characters")
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"tenant for key {key[:4]}... must be a non-empty string")
        out[key] = tenant
    return out


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant name (ANONYMOUS when keys are off) and whether they are admin."""

    tenant: str
    is_admin: bool = False

    def namespace(self, cache_salt: str | None) -> Namespace:
        if self.tenant == ANONYMOUS and cache_salt is None:
            return None
        if cache_salt is None:
            return (self.tenant,)
        return (self.tenant, cache_salt)


class Authenticator:
    """Maps ``Authorization: Bearer KEY`` headers to a Principal.

    Keys are compared by SHA-256 digest (dict lookup on the digest leaks nothing useful about
    the key) and the admin key with ``hmac.compare_digest``.
    """

    def __init__(self, api_keys: Mapping[str, str] | None, admin_key: str | None) -> None:
        self._tenants = (
            {_digest(k): t for k, t in validate_api_keys(dict(api_keys)).items()}
            if api_keys
            else {}
        )
        if admin_key is not None and len(admin_key) < 8:
            raise ValueError("admin key must be at least 8 characters")
        self._admin = _digest(admin_key) if admin_key is not None else None

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    @staticmethod
    def bearer(authorization: str | None) -> str | None:
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return token.strip()

    def is_admin(self, authorization: str | None) -> bool:
        token = self.bearer(authorization)
        if token is None or self._admin is None:
            return False
        return hmac.compare_digest(_digest(token), self._admin)

    def authenticate(self, authorization: str | None) -> Principal:
        """Principal for a generation request; raises 401 APIError when keys are on and it fails."""
        if not self.enabled:
            return Principal(ANONYMOUS)
        token = self.bearer(authorization)
        if token is None:
            raise unauthorized("Missing API key: send Authorization: Bearer <key>")
        tenant = self._tenants.get(_digest(token))
        if tenant is None:
            raise unauthorized("Invalid API key")
        return Principal(tenant)

    def require_admin(self, authorization: str | None) -> None:
        if self._admin is None:
            raise APIError(403, "Admin endpoints are disabled (start the server with --admin-key)")
        if not self.is_admin(authorization):
            raise unauthorized("This endpoint needs the admin key")
