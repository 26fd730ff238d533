"""The cache's counters as each proxy reports them, read from its stats in Prometheus text format.

Every Envoy serves its stats as Prometheus text: the admin endpoint `/stats/prometheus` (local
mesh, plain Envoy) and, in an Istio pod, the agent's merged `:15020/stats/prometheus` (what
Prometheus scrapes there). The control plane reads that on demand (the status page, `meshcache
status`), bounded in time, size and fan-out, and keeps each reading for `cache_s`.

Where a proxy's stats come from is configured per node id (`node=url` entries) or by a template
with `{ip}` filled from an Istio node id (`sidecar~<ip>~<pod>.<ns>~...`). Proxies that do not take
their configuration from this control plane (Istio sidecars fed by istiod) are found by DNS: each
address a name resolves to (a headless Service selecting the pods: one A record per ready pod)
is read through the template, as proxy `<name>/<ip>`. A proxy without a source, whose stats
can't be read, or a name that does not resolve, is reported as such with the reason, never as
zeros.

Envoy exports a Wasm filter's stats (`wasmcustom.` namespace) in Prometheus text without its
`envoy_` prefix and namespace: `meshcache.hits` becomes `meshcache_hits`, and the per-policy
counter `meshcache.policy.<prefix>.hits` becomes `meshcache_policy_<name>_hits`, where <name> is
the prefix with every character outside [A-Za-z0-9_] replaced by `_` (the filter keeps `-`,
Envoy's Prometheus output does not). Per-policy gauges `meshcache_policy_<name>_entries|bytes`
and `meshcache_unattributed_entries|bytes` (entries no configured policy claims) add up to
`meshcache_entries|bytes`; a filter build without them (no `meshcache_unattributed_entries`)
reports entries and bytes per proxy only, and its per-model entries are unknown, not zero.
The native host (the Envoy dynamic module) defines the same stats in the same `wasmcustom.`
namespace, but Envoy leaves that namespace (and `envoy_`) in the Prometheus names unless a Wasm
filter registered it in the same process: `envoy_wasmcustom_meshcache_hits` is read as
`meshcache_hits`.
So a name maps back to the prefixes of the current snapshot that reduce to it; if two do, the
counters can't be told apart and are reported under both names as ambiguous.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

PROM_PREFIX = "meshcache_"
NATIVE_PROM_PREFIX = "envoy_wasmcustom_"  # before PROM_PREFIX in an Envoy running only the native host
# The filter's cache-wide counters and gauges (docs/filter.md, "Metrics").
COUNTERS = ("hits", "misses", "bypasses", "stores", "evictions", "errors")
GAUGES = ("entries", "bytes")
# Per policy: counters, gauges, and the tokens served from cache (the stored answers' `usage`).
TOKENS = ("tokens_saved_prompt", "tokens_saved_completion")
_POLICY = re.compile(r"^policy_(.+)_(hits|misses|entries|bytes|tokens_saved_prompt|tokens_saved_completion)$")
# The semantic layer's counters (docs/llm.md): lookups on exact misses, hits served, would-be hits
# in shadow mode, failed lookups (the filter went upstream).
SEMANTIC = ("lookups", "hits", "would_hit", "errors")
_SEMANTIC = re.compile(r"^semantic_(lookups|hits|would_hit|errors)$")
_UNATTRIBUTED = re.compile(r"^unattributed_(entries|bytes)$")
_ISTIO_NODE = re.compile(r"^[a-z]+~([0-9a-fA-F.:]+)~")
_SOURCE = re.compile(r"^([^=\s]{1,256})=(\S+)$")
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?$")


class StatsConfigError(ValueError):
    pass


def prom_name(model_prefix: str) -> str:
    """The per-policy part of the Prometheus name the filter's counters get for this prefix."""
    return re.sub(r"[^A-Za-z0-9_]", "_", model_prefix)


def _check_url(url: str, where: str) -> str:
    parts = urlsplit(url.replace("{ip}", "127.0.0.1"))
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise StatsConfigError(f"{where}: {url!r} is not an http(s) URL")
    return url


def parse_sources(text: str) -> dict[str, str]:
    """`node_id=url` entries, comma- or newline-separated, into {node_id: url}."""
    out: dict[str, str] = {}
    for n, raw in enumerate(re.split(r"[\n,]", text), start=1):
        entry = raw.strip()
        if not entry or entry.startswith("#"):
            continue
        m = _SOURCE.match(entry)
        if not m:
            raise StatsConfigError(f"proxy stats entry {n} is not `node_id=url`: {entry[:80]!r}")
        out[m.group(1)] = _check_url(m.group(2), f"proxy stats entry {n}")
    return out


def parse_dns_names(text: str) -> list[str]:
    """Comma- or newline-separated DNS names whose addresses are proxies to read."""
    names = [n.strip() for n in re.split(r"[\n,]", text) if n.strip()]
    for n in names:
        if not _DNS_NAME.match(n):
            raise StatsConfigError(f"proxy stats DNS name {n[:80]!r} is not a host name")
    return list(dict.fromkeys(names))


@dataclass
class ProxyCounters:
    """One proxy's cache counters (cumulative since that Envoy started) and gauges."""

    totals: dict[str, int] = field(default_factory=dict)
    # Per-policy counters and gauges keyed by the Prometheus-safe name:
    # {name: {"hits": n, "misses": n, "entries": n, "bytes": n}} (gauges only if the filter has them).
    policies: dict[str, dict[str, int]] = field(default_factory=dict)
    # Entries and bytes no configured policy claims; empty if the filter predates per-policy gauges.
    unattributed: dict[str, int] = field(default_factory=dict)
    # meshcache.semantic.* counters; empty if the filter has no semantic layer.
    semantic: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_known(self) -> bool:
        """Whether this filter counts tokens saved (any policy's series present)."""
        return any(TOKENS[0] in per for per in self.policies.values())

    @property
    def per_policy_gauges(self) -> bool:
        return "entries" in self.unattributed


def parse_prometheus(text: str) -> ProxyCounters:
    """The filter's samples in a Prometheus text page (other metrics are ignored)."""
    out = ProxyCounters()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix(NATIVE_PROM_PREFIX)
            if not name.startswith(PROM_PREFIX):
                continue
            rest = name[len(PROM_PREFIX):].removesuffix("_total")
            value = int(sample.value)
            m = _POLICY.match(rest)
            u = _UNATTRIBUTED.match(rest)
            sem = _SEMANTIC.match(rest)
            if sem:
                out.semantic[sem.group(1)] = out.semantic.get(sem.group(1), 0) + value
            elif m:
                per = out.policies.setdefault(m.group(1), {"hits": 0, "misses": 0})
                per[m.group(2)] = per.get(m.group(2), 0) + value
            elif u:
                out.unattributed[u.group(1)] = out.unattributed.get(u.group(1), 0) + value
            elif rest in COUNTERS or rest in GAUGES:
                out.totals[rest] = out.totals.get(rest, 0) + value
    return out


@dataclass
class ProxyReading:
    node_id: str
    source: str | None
    ok: bool
    error: str | None
    read_at: float
    counters: ProxyCounters | None = None


class ProxyStatsReader:
    def __init__(self, sources: dict[str, str], template: str = "", timeout_s: float = 1.0,
                 max_bytes: int = 8 * 1024 * 1024, max_proxies: int = 200, cache_s: float = 2.0,
                 concurrency: int = 16, dns_names: list[str] | None = None) -> None:
        self.sources = dict(sources)
        self.template = _check_url(template, "proxy stats template") if template else ""
        self.dns_names = list(dns_names or [])
        if self.dns_names and "{ip}" not in self.template:
            raise StatsConfigError("proxy stats DNS names need a proxy stats template with {ip}")
        # name -> (resolved at, addresses or the error); node id -> URL of the last resolution.
        self._resolved: dict[str, tuple[float, list[str] | str]] = {}
        self._discovered: dict[str, str] = {}
        self.timeout_s, self.max_bytes, self.max_proxies = timeout_s, max_bytes, max_proxies
        self.cache_s = cache_s
        self._gate = asyncio.Semaphore(concurrency)
        self._cache: dict[str, ProxyReading] = {}
        self._client: httpx.AsyncClient | None = None

    def _fill(self, ip: str) -> str:
        return self.template.replace("{ip}", f"[{ip}]" if ":" in ip else ip)

    def source_of(self, node_id: str) -> str | None:
        if node_id in self.sources:
            return self.sources[node_id]
        if node_id in self._discovered:
            return self._discovered[node_id]
        m = _ISTIO_NODE.match(node_id)
        if self.template and m:
            return self._fill(m.group(1))
        return None

    async def _resolve(self, name: str) -> list[str] | str:
        """The name's addresses (sorted, at most max_proxies), or why there are none."""
        cached = self._resolved.get(name)
        now = time.time()
        if cached is not None and now - cached[0] < self.cache_s:
            return cached[1]
        try:
            async with asyncio.timeout(self.timeout_s):
                infos = await asyncio.get_running_loop().getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
            found: list[str] | str = sorted({str(i[4][0]) for i in infos})[:self.max_proxies]
            if not found:
                found = f"DNS name {name} resolves to no address"
        except TimeoutError:
            found = f"DNS lookup of {name} took longer than {self.timeout_s:g}s"
        except OSError as exc:
            found = f"DNS lookup of {name} failed: {exc}"
        self._resolved[name] = (now, found)
        return found

    async def _discover(self) -> tuple[list[str], list[ProxyReading]]:
        """Proxies found by DNS (node ids `<name>/<ip>`), and a failed reading per name that
        did not resolve."""
        found: dict[str, str] = {}
        failed = []
        resolved = await asyncio.gather(*(self._resolve(n) for n in self.dns_names))
        for name, addrs in zip(self.dns_names, resolved, strict=True):
            if isinstance(addrs, str):
                failed.append(ProxyReading(f"{name} (DNS)", None, False, addrs, time.time()))
                continue
            for ip in addrs:
                found[f"{name}/{ip}"] = self._fill(ip)
        self._discovered = found
        return list(found), failed

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def read(self, node_ids: list[str]) -> list[ProxyReading]:
        """A reading for every proxy in `node_ids` plus every configured one (bounded fan-out)."""
        discovered, failed = await self._discover() if self.dns_names else ([], [])
        wanted = list(dict.fromkeys([*node_ids, *self.sources, *discovered]))
        over = wanted[self.max_proxies:]
        readings = await asyncio.gather(*(self._read_one(n) for n in wanted[:self.max_proxies]))
        now = time.time()
        return [*readings, *failed, *(ProxyReading(n, self.source_of(n), False,
                                                   f"not read: more than {self.max_proxies} proxies", now)
                                      for n in over)]

    async def _read_one(self, node_id: str) -> ProxyReading:
        url = self.source_of(node_id)
        now = time.time()
        if url is None:
            return ProxyReading(node_id, None, False, "no stats source configured for this proxy", now)
        cached = self._cache.get(node_id)
        if cached is not None and cached.source == url and now - cached.read_at < self.cache_s:
            return cached
        async with self._gate:
            reading = await self._fetch(node_id, url)
        self._cache[node_id] = reading
        if len(self._cache) > 2 * self.max_proxies:  # forget proxies long gone
            for stale in sorted(self._cache, key=lambda k: self._cache[k].read_at)[:self.max_proxies]:
                del self._cache[stale]
        return reading

    async def _fetch(self, node_id: str, url: str) -> ProxyReading:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False)
        started = time.time()
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._client.stream("GET", url) as r:
                    if r.status_code != 200:
                        return ProxyReading(node_id, url, False, f"HTTP {r.status_code} from {url}", started)
                    body = bytearray()
                    async for chunk in r.aiter_bytes():
                        body += chunk
                        if len(body) > self.max_bytes:
                            return ProxyReading(node_id, url, False,
                                                f"stats page larger than {self.max_bytes} bytes", started)
            counters = parse_prometheus(body.decode("utf-8", errors="replace"))
        except TimeoutError:
            return ProxyReading(node_id, url, False, f"no answer from {url} within {self.timeout_s:g}s", started)
        except httpx.HTTPError as exc:
            return ProxyReading(node_id, url, False, f"{url}: {type(exc).__name__}: {exc}", started)
        except ValueError as exc:  # not Prometheus text
            return ProxyReading(node_id, url, False, f"{url}: unreadable stats: {exc}", started)
        if not counters.totals:
            return ProxyReading(node_id, url, False, "no meshcache filter stats in the answer "
                                "(filter not loaded, or stats not exported)", started, counters)
        return ProxyReading(node_id, url, True, None, started, counters)


@dataclass
class ModelRow:
    model_prefix: str
    in_policy: bool
    hits: int
    misses: int
    ambiguous_with: list[str]
    # None when a readable proxy's filter does not report entries and bytes per policy.
    entries: int | None = None
    bytes: int | None = None
    # Prompt and completion tokens answered from the cache; None when no proxy read counts them.
    tokens_saved_prompt: int | None = None
    tokens_saved_completion: int | None = None

    @property
    def hit_ratio(self) -> float | None:
        seen = self.hits + self.misses
        return self.hits / seen if seen else None


def _gauges_known(readings: list[ProxyReading]) -> bool:
    """True when some proxy was read and every one read reports entries and bytes per policy."""
    read = [r.counters for r in readings if r.ok and r.counters is not None]
    return bool(read) and all(c.per_policy_gauges for c in read)


def per_model(readings: list[ProxyReading], prefixes: list[str]) -> list[ModelRow]:
    """Sum the per-policy counters and gauges of the readable proxies, named by the snapshot's
    prefixes. A proxy without a policy's gauges holds none of its entries (its filter does not
    have that policy), so it adds 0, unless its filter has no per-policy gauges at all."""
    by_name: dict[str, list[str]] = {}
    for p in prefixes:
        by_name.setdefault(prom_name(p), []).append(p)
    zero = {"hits": 0, "misses": 0, "entries": 0, "bytes": 0, TOKENS[0]: 0, TOKENS[1]: 0}
    sums: dict[str, dict[str, int]] = {}
    for r in readings:
        if r.ok and r.counters is not None:
            for name, c in r.counters.policies.items():
                s = sums.setdefault(name, dict(zero))
                for what in zero:
                    s[what] += c.get(what, 0)
    known = _gauges_known(readings)
    # Tokens: a filter that counts them has the series for every policy it has; one that does not
    # (older build) leaves them unknown, never 0.
    tokens = any(r.counters.tokens_known for r in readings if r.ok and r.counters is not None)

    def row(prefix: str, in_policy: bool, s: dict[str, int], ambiguous: list[str]) -> ModelRow:
        return ModelRow(prefix, in_policy, s["hits"], s["misses"], ambiguous,
                        s["entries"] if known else None, s["bytes"] if known else None,
                        s[TOKENS[0]] if tokens else None, s[TOKENS[1]] if tokens else None)

    rows = []
    for p in prefixes:
        name = prom_name(p)
        rows.append(row(p, True, sums.get(name, zero), [o for o in by_name[name] if o != p]))
    for name, s in sorted(sums.items()):
        if name not in by_name:  # counters of a policy no longer in the snapshot
            rows.append(row(name, False, s, []))
    return rows


def semantic_totals(readings: list[ProxyReading]) -> dict[str, int] | None:
    """The semantic layer's counters summed over the readable proxies; None if none has them."""
    read = [r.counters for r in readings if r.ok and r.counters is not None and r.counters.semantic]
    if not read:
        return None
    return {what: sum(c.semantic.get(what, 0) for c in read) for what in SEMANTIC}


def unattributed(readings: list[ProxyReading]) -> tuple[int | None, int | None]:
    """(entries, bytes) no proxy's configured policies claim, summed; None if unknown."""
    read = [r.counters for r in readings if r.ok and r.counters is not None]
    if not _gauges_known(readings):
        return None, None
    return sum(c.unattributed.get("entries", 0) for c in read), sum(c.unattributed.get("bytes", 0) for c in read)
