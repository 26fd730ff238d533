"""Bearer tokens with a role (read or write), loaded from a file and/or an env var.

Entries are `role:name:token`. Tokens are compared as SHA-256 digests with hmac.compare_digest
against every entry (no early exit), so timing reveals neither the token nor its length.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from typing import Literal

from .settings import Settings

Role = Literal["read", "write"]
_ENTRY = re.compile(r"^(read|write):([A-Za-z0-9_.@-]{1,64}):(\S{16,512})$")


class TokenConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Principal:
    name: str
    role: Role

    def can(self, needed: Role) -> bool:
        return needed == "read" or self.role == "write"


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    principal: Principal


class TokenTable:
    def __init__(self, entries: list[tuple[Role, str, str]]) -> None:
        self._entries = [
            _Entry(hashlib.sha256(token.encode()).digest(), Principal(name, role))
            for role, name, token in entries
        ]

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, token: str) -> Principal | None:
        digest = hashlib.sha256(token.encode(errors="replace")).digest()
        found: Principal | None = None
        for e in self._entries:
            if hmac.compare_digest(digest, e.digest):
                found = e.principal
        return found

    @staticmethod
    def parse(text: str, source: str) -> list[tuple[Role, str, str]]:
        out: list[tuple[Role, str, str]] = []
        for n, raw in enumerate(re.split(r"[\n,]", text), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            m = _ENTRY.match(line)
            if not m:
                raise TokenConfigError(
                    f"{source}: entry {n} is not `read|write:name:token` (token of 16+ chars)")
            role: Role = "write" if m.group(1) == "write" else "read"
            out.append((role, m.group(2), m.group(3)))
        return out

    @classmethod
    def from_settings(cls, settings: Settings) -> TokenTable:
        entries: list[tuple[Role, str, str]] = []
        if settings.tokens_file is not None:
            entries += cls.parse(settings.tokens_file.read_text(), str(settings.tokens_file))
        if settings.tokens:
            entries += cls.parse(settings.tokens, "MESHCACHE_CP_TOKENS")
        return cls(entries)
