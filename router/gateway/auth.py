"""API keys: who may call the gateway, and which prefix-cache tenant each caller is.

Every key is compared in constant time against every configured key (the loop never exits
early), so response timing says nothing about how much of a guessed key was right. Each key is
its own tenant: its cache salt is a hash of the key, so cached prefixes never cross keys and
the salt reveals nothing about the key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from router.gateway.errors import ApiError

_SALT_DOMAIN = b"pdserve tenant cache salt\x00"


@dataclass(frozen=True, slots=True)
class Caller:
    tenant_salt: str | None  # prefix-cache salt of the caller's key; None without keys


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [key.encode() for key in keys]
        for key in self._keys:
            if not key or key.strip() != key:
                raise ValueError("API keys must be non-empty and have no surrounding whitespace")

    @classmethod
    def from_sources(cls, keys: Iterable[str], key_file: str | None) -> ApiKeys:
        """Keys from ``--api-key`` flags plus one per non-empty, non-# line of a key file."""
        all_keys = list(keys)
        if key_file is not None:
            for line in Path(key_file).read_text().splitlines():
                if line.strip() and not line.lstrip().startswith("#"):
                    all_keys.append(line.strip())
        return cls(all_keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller behind an ``Authorization`` value ("Bearer KEY"), or ApiError(401)."""
        if not self._keys:
            return Caller(None)
        if not authorization:
            raise _unauthorized("missing API key: send the header 'Authorization: Bearer KEY'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _unauthorized("malformed Authorization header: expected 'Bearer KEY'")
        candidate = token.strip().encode()
        matched: bytes | None = None
        for key in self._keys:
            if hmac.compare_digest(candidate, key):
                matched = key
        if matched is None:
            raise _unauthorized("incorrect API key provided")
        return Caller(hashlib.sha256(_SALT_DOMAIN + matched).hexdigest()[:32])


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "invalid_request_error", code="invalid_api_key")
