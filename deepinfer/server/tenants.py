"""API keys as tenants: which key a request presented, and the cache namespace that key owns.

Every `--api-key` is a tenant. Its prefix cache namespace (`Tenant.cache_id`) enters the root of
every KV block hash (`kvcache/hashing.py`), so one tenant's cached prefixes are never another's
hits, in any tier, whatever `cache_salt` either sends: a shared cache would otherwise leak prompts
through timing (a prefix someone else sent comes back faster).

Sharing is explicit: `--api-key KEY=GROUP` puts the key in cache group GROUP, and keys of one group
share one namespace (say, the keys of one team, or an old and a new key during a rotation). The text
after the last `=` names the group when it is not empty, so keys ending in base64 padding (`abc==`)
need no care; a key with `=` inside must be given with a group.

The namespace id is a hash of the key (or of the group name): stable across restarts and processes
(the persistent store keeps working), never the key itself.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

_PERSON = b"deepinfer-tenant"  # blake2b personalization: these hashes name tenants and nothing else


def cache_id(key: str | None = None, group: str | None = None) -> str:
    """The cache namespace of an API key without a group, or of a group (keys and groups never collide)."""
    if (key is None) == (group is None):
        raise ValueError("give either a key or a group")
    data = b"key\0" + key.encode() if key is not None else b"group\0" + group.encode()  # type: ignore[union-attr]
    return hashlib.blake2b(data, digest_size=16, person=_PERSON).hexdigest()


@dataclass(frozen=True)
class Tenant:
    cache_id: str  # what enters the block hashes
    group: str | None = None  # the cache group the key was given with, if any


def parse_key_spec(spec: str) -> tuple[str, str | None]:
    """`KEY` or `KEY=GROUP` -> (key, group or None)."""
    key, sep, group = spec.rpartition("=")
    if not sep or not group:
        key, group = spec, ""
    if not key.strip():
        raise ValueError("an --api-key is empty" if not group else f"--api-key ={group} names no key")
    return key, group or None


class Tenants:
    """The configured keys; `match` finds the tenant of a presented key. Only hashes of the keys are kept,
    and every presented key is compared with all of them in constant time (no early exit that would
    tell a prober how close it came)."""

    def __init__(self, specs: Iterable[str]) -> None:
        self._entries: list[tuple[bytes, Tenant]] = []
        for spec in specs:
            key, group = parse_key_spec(spec)
            tenant = Tenant(cache_id(group=group) if group else cache_id(key=key), group)
            digest = hashlib.sha256(key.encode()).digest()
            if any(d == digest for d, _ in self._entries):
                raise ValueError("an --api-key is given twice")
            self._entries.append((digest, tenant))

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, presented: str) -> Tenant | None:
        digest = hashlib.sha256(presented.encode()).digest()
        found: Tenant | None = None
        for key_digest, tenant in self._entries:
            if hmac.compare_digest(digest, key_digest):
                found = tenant
        return found
