"""Which models the engines serve (their KServe repository index), so a policy whose prefix
matches none of them gets a warning: it is applied anyway (the model may come later), but a typo
would otherwise cache nothing, silently.

The engines are configured as base URLs (`engine_index`); each is asked `POST
/v2/repository/index` on demand, bounded in time, size and fan-out, and the answer is kept for
`CACHE_S` so a burst of writes does not fan out again.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import httpx

MAX_ENGINES = 64
MAX_INDEX_BYTES = 1 << 20
CACHE_S = 2.0
SHOWN = 10  # model names listed in a warning


class IndexConfigError(ValueError):
    pass


def parse_engine_urls(text: str) -> list[str]:
    """Comma-separated http(s) base URLs of the engines' REST ports."""
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    if len(urls) > MAX_ENGINES:
        raise IndexConfigError(f"engine_index: at most {MAX_ENGINES} engines")
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise IndexConfigError(f"engine_index: {url!r} is not an http(s) URL")
    return urls


def index_names(where: str, rows: object) -> set[str]:
    """The model names of one engine's repository index (KServe v2: a list of {"name": ...})."""
    if not isinstance(rows, list):
        raise ValueError(f"{where}: the index is not a list")
    return {row["name"] for row in rows if isinstance(row, dict) and isinstance(row.get("name"), str)}


def prefix_warnings(model_prefix: str, names: set[str], errors: list[str]) -> list[str]:
    """Warnings for a policy with this prefix, given the engines' model names and why some could
    not be read: the one rule, for the control plane and for the CLI (a kube mesh's engine pods)."""
    warnings = []
    if errors:
        warnings.append("could not read every engine's model index (" + "; ".join(errors[:3]) + ")")
    if names and not any(n.startswith(model_prefix) for n in names):
        shown = ", ".join(sorted(names)[:SHOWN]) + (", ..." if len(names) > SHOWN else "")
        warnings.append(f"model_prefix {model_prefix!r} matches no model the engines serve ({shown}); "
                        "applied anyway")
    return warnings


class ModelIndex:
    def __init__(self, urls: list[str], timeout_s: float) -> None:
        self.urls = urls
        self.timeout_s = timeout_s
        self._read: tuple[float, set[str], list[str]] | None = None

    async def _one(self, client: httpx.AsyncClient, url: str) -> set[str]:
        r = await client.post(f"{url}/v2/repository/index", json={})
        if r.status_code != 200:
            raise ValueError(f"{url}: HTTP {r.status_code}")
        if len(r.content) > MAX_INDEX_BYTES:
            raise ValueError(f"{url}: index larger than {MAX_INDEX_BYTES} bytes")
        return index_names(url, r.json())

    async def models(self) -> tuple[set[str], list[str]]:
        """Every model name the engines list, and why an engine could not be read."""
        if self._read is not None and time.monotonic() - self._read[0] < CACHE_S:
            return self._read[1], self._read[2]
        names: set[str] = set()
        errors: list[str] = []
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            results = await asyncio.gather(*(self._one(client, u) for u in self.urls), return_exceptions=True)
        for url, result in zip(self.urls, results, strict=True):
            if isinstance(result, BaseException):
                errors.append(str(result) if isinstance(result, ValueError) else f"{url}: {type(result).__name__}")
            else:
                names |= result
        self._read = (time.monotonic(), names, errors)
        return names, errors

    async def prefix_warnings(self, model_prefix: str) -> list[str]:
        """Warnings for a policy with this prefix (none when no engines are configured)."""
        if not self.urls:
            return []
        names, errors = await self.models()
        return prefix_warnings(model_prefix, names, errors)
