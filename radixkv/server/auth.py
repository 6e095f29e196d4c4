"""API keys, tenants and the prefix-cache namespace a request runs in.

Tenant isolation against the prefix-cache timing side channel: the namespace is derived on the
server from the *authenticated* tenant, never from a client field. A client ``cache_salt`` may only
narrow sharing further inside that tenant: namespace = (tenant, cache_salt), so two tenants can never
end up in the same namespace whatever salts they send.

Without configured keys the server is open (one anonymous tenant); ``cache_salt`` still splits it.

Revoking a key needs no restart: with a key file, the Authenticator re-reads it when the file
changes (checked by ``os.stat`` on each authentication: a syscall, no read), at least once a
second while requests come (a read, so a rewrite that keeps the size and falls within the
file system's timestamp resolution is seen too), or after ``request_reload()`` (what ``radixkv
serve`` calls on SIGHUP). Revocation fails closed: a file that is deleted, unreadable, empty,
not JSON or without keys (``{}``) revokes every tenant key (the admin key stays) and logs why,
until a valid file is written again.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from radixkv.server.errors import APIError, unauthorized

# The namespace handed to the engine / cache: None (shared, no keys, no salt) or a tuple of strings.
Namespace = tuple[str, ...] | None

ANONYMOUS = ""
# at most this long between two reads of the key file while requests come
RECHECK_S = 1.0

log = logging.getLogger("radixkv.server")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def load_api_keys(path: str | Path) -> dict[str, str]:
    """Read a JSON object mapping API key -> tenant name; ValueError names what is wrong."""
    try:
        text = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read API key file {path}: {e}") from None
    return parse_api_keys(text, path)


def parse_api_keys(text: bytes, path: str | Path) -> dict[str, str]:
    """The keys of a key file's contents ``text``; ValueError names what is wrong."""
    try:
        raw = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
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


def request_authorization(headers: Mapping[str, str]) -> str | None:
    """A request's credentials as an ``Authorization`` value: its bearer token, or
    Anthropic's ``x-api-key`` header as one (its SDKs send the key there)."""
    value = headers.get("authorization")
    if value is None and headers.get("x-api-key"):
        value = f"Bearer {headers.get('x-api-key')}"
    return value


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


def _file_version(path: Path) -> tuple[int, int, int] | None:
    """What changes when the file is rewritten or replaced; None if it cannot be stat'ed."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class Authenticator:
    """Maps ``Authorization: Bearer KEY`` headers to a Principal.

    Keys are compared by SHA-256 digest (dict lookup on the digest leaks nothing useful about
    the key) and the admin key with ``hmac.compare_digest``. With ``keys_file`` the keys are
    that file's (``api_keys``, if also given, are what was read from it) and are reloaded when
    it changes (see the module doc).
    """

    def __init__(
        self,
        api_keys: Mapping[str, str] | None,
        admin_key: str | None,
        *,
        keys_file: str | Path | None = None,
    ) -> None:
        self._file = Path(keys_file) if keys_file is not None else None
        self._file_version = _file_version(self._file) if self._file is not None else None
        self._file_digest: bytes | None = None  # of the contents the keys were read from
        self._read_at = time.monotonic()
        self._reload_requested = False
        self._revoked_because: str | None = None  # why the file's keys are not in force
        if self._file is not None and api_keys is None:
            text = self._read_file()
            api_keys = parse_api_keys(text, self._file)
            self._file_digest = hashlib.sha256(text).digest()
        self._tenants = self._digests(api_keys)
        self._num_tenants = len(set(self._tenants.values()))
        if admin_key is not None and len(admin_key) < 8:
            raise ValueError("admin key must be at least 8 characters")
        self._admin = _digest(admin_key) if admin_key is not None else None

    @staticmethod
    def _digests(api_keys: Mapping[str, str] | None) -> dict[bytes, str]:
        if not api_keys:
            return {}
        return {_digest(k): t for k, t in validate_api_keys(dict(api_keys)).items()}

    def _read_file(self) -> bytes:
        assert self._file is not None
        try:
            return self._file.read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read API key file {self._file}: {e}") from None

    # ------------------------------------------------------------ reloading
    def request_reload(self) -> None:
        """Re-read the key file before the next authentication (async-signal-safe: sets a flag)."""
        self._reload_requested = True

    def reload(self) -> bool:
        """Re-read the key file now. On success its keys replace the old ones (a removed key is
        refused from the next request on) and True is returned. On failure (deleted,
        unreadable, not JSON, no keys) every tenant key is revoked, the reason is logged (once
        per reason) and False is returned: the admin key alone works until the file is fixed.
        No-op (False) without a key file."""
        self._reload_requested = False
        if self._file is None:
            return False
        self._file_version = _file_version(self._file)
        self._read_at = time.monotonic()
        try:
            text = self._read_file()
            digest = hashlib.sha256(text).digest()
            if digest == self._file_digest and self._revoked_because is None:
                return True  # the same keys
            tenants = self._digests(parse_api_keys(text, self._file))
        except ValueError as e:
            self._file_digest = None
            if self._revoked_because != str(e):
                log.error(
                    "API keys revoked (key file %s): %s; every tenant key is refused until the "
                    "file holds valid keys again (the admin key still works)",
                    self._file,
                    e,
                )
            self._revoked_because = str(e)
            self._tenants = {}
            self._num_tenants = 0
            return False
        added = len(tenants.keys() - self._tenants.keys())
        removed = len(self._tenants.keys() - tenants.keys())
        changed = tenants != self._tenants or self._revoked_because is not None
        self._tenants = tenants
        self._num_tenants = len(set(tenants.values()))
        self._file_digest = digest
        self._revoked_because = None
        if changed:
            log.info("API keys reloaded from %s: %d added, %d removed", self._file, added, removed)
        return True

    def _refresh(self) -> None:
        if self._file is None:
            return
        if (
            self._reload_requested
            or _file_version(self._file) != self._file_version
            or time.monotonic() - self._read_at >= RECHECK_S
        ):
            self.reload()

    @property
    def num_tenants(self) -> int:
        """How many tenants the keys in force name (0 without keys: one anonymous tenant)."""
        return self._num_tenants

    @property
    def enabled(self) -> bool:
        return bool(self._tenants) or self._file is not None

    def is_key(self, authorization: str | None) -> bool:
        """True for any configured key: a tenant's or the admin key."""
        self._refresh()
        token = self.bearer(authorization)
        return token is not None and (
            _digest(token) in self._tenants or self.is_admin(authorization)
        )

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
        self._refresh()
        token = self.bearer(authorization)
        if token is None:
            raise unauthorized("Missing API key: send Authorization: Bearer <key>")
        tenant = self._tenants.get(_digest(token))
        if tenant is None:
            raise unauthorized("Invalid API key")
        return Principal(tenant)

    def require_key(self, authorization: str | None, what: str) -> None:
        """401 unless ``authorization`` holds a configured key (a tenant's or the admin key);
        ``what`` names the route in the message."""
        if not self.is_key(authorization):
            raise unauthorized(f"{what} needs an API key or the admin key")

    def require_admin(self, authorization: str | None) -> None:
        if self._admin is None:
            raise APIError(403, "Admin endpoints are disabled (start the server with --admin-key)")
        if not self.is_admin(authorization):
            raise unauthorized("This endpoint needs the admin key")
