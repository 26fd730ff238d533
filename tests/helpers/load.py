"""Light, checked load through a running mesh: every answer is compared with the expected bytes.

The default request kinds (KINDS) cover the paths a component failure can touch: cached gRPC and
REST (hits from the server sidecar), `Cache-Control: no-store` requests that always reach an
engine, and the canary colour; their expected bytes come from the engines directly, before any
load (`expected_answers`; the engine's answers do not depend on batching:
tests/engine/test_batching.py). A test may pass its own kinds (`rest_kinds`) and expected bytes.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from meshcache.contract.headers import CACHE_STATUS_HEADER
from meshcache.ctl import procs
from tests.helpers.kserve import MLP, MODEL_INFER, infer_path, mlp_json, mlp_request
from tests.helpers.wait import eventually

NO_STORE = {"cache-control": "no-store"}
BLUE = {"x-traffic-color": "blue"}


@dataclass(frozen=True)
class Kind:
    name: str
    grpc: bool
    headers: tuple[tuple[str, str], ...]
    seed: int
    canary: bool = False  # answered by the canary engine


KINDS = (
    Kind("grpc-hit", True, (), 7101),
    Kind("rest-hit", False, (), 7102),
    Kind("grpc-engine", True, tuple(NO_STORE.items()), 7103),
    Kind("rest-engine", False, tuple(NO_STORE.items()), 7104),
    Kind("rest-blue-hit", False, tuple(BLUE.items()), 7105, canary=True),
    Kind("rest-blue-engine", False, tuple({**BLUE, **NO_STORE}.items()), 7106, canary=True),
)


def rest_kinds(seeds: range, headers: dict[str, str] | None = None) -> tuple[Kind, ...]:
    """One REST kind per seed (`rest-<seed>`), each with `headers`."""
    return tuple(Kind(f"rest-{seed}", False, tuple((headers or {}).items()), seed) for seed in seeds)


# Reconnect quickly after the peer came back (grpcio's default first backoff is 1 s).
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 500)]


class Client:
    """Keep-alive HTTP and one gRPC channel to `target`: few ephemeral ports on a shared machine
    (a port in use by a client socket cannot be bound by a mesh that picked it as "free")."""

    def __init__(self, target: str, timeout_s: float = 5.0) -> None:
        self.target = target
        self.http = procs.http_client(timeout=timeout_s)
        self.channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)

    def close(self) -> None:
        self.http.close()
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def call(kind: Kind, target: str | Client, timeout: float = 5.0) -> bytes:
    """One request of `kind` to `target` (host:port, or a Client); the answer's bytes, or an exception."""
    return call_with_status(kind, target, timeout)[0]


def call_with_status(kind: Kind, target: str | Client, timeout: float = 5.0) -> tuple[bytes, str]:
    """`call`, and the answer's Cache-Status."""
    if isinstance(target, str):
        with Client(target) as client:
            return call_with_status(kind, client, timeout)
    if kind.grpc:
        body = mlp_request(kind.seed).SerializeToString()
        response, c = target.channel.unary_unary(MODEL_INFER).with_call(body, metadata=kind.headers, timeout=timeout)
        return response, dict(c.initial_metadata()).get(CACHE_STATUS_HEADER, "")
    r = target.http.post(f"http://{target.target}{infer_path(MLP)}", json=mlp_json(kind.seed),
                         headers=dict(kind.headers), timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
    return r.content, r.headers.get(CACHE_STATUS_HEADER, "")


def expected_answers(engine_http: int, engine_grpc: int, canary_http: int) -> dict[str, bytes]:
    out = {}
    for kind in KINDS:
        port = (canary_http if kind.canary else engine_grpc if kind.grpc else engine_http)
        out[kind.name] = call(kind, f"127.0.0.1:{port}")
    return out


@dataclass
class Outcome:
    at: float  # time.monotonic() when the answer came
    kind: str
    ok: bool
    wrong: bool = False  # an answer, but not the expected bytes
    error: str = ""
    started: float = 0.0  # time.monotonic() when the request was sent
    caller: int = 0  # which of the load's threads sent it
    hit: bool = False  # a right answer from the cache (Cache-Status `meshcache; hit...`)


@dataclass
class Load:
    """`threads` callers, each cycling through `kinds` with `pause_s` between requests, each
    request waiting at most `timeout_s`. Also a context manager (started, stopped)."""

    target: str
    expected: dict[str, bytes]
    threads: int = 2
    pause_s: float = 0.02
    kinds: tuple[Kind, ...] = KINDS
    timeout_s: float = 5.0
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _run(self, caller: int) -> None:
        with Client(self.target, self.timeout_s) as client:
            self._loop(client, caller)

    def _loop(self, client: Client, caller: int) -> None:
        i = caller * 3
        deadline = time.monotonic() + 600  # bounded even if stop() is never called
        while not self._stop.is_set() and time.monotonic() < deadline:
            kind = self.kinds[i % len(self.kinds)]
            i += 1
            started = time.monotonic()
            try:
                answer, status = call_with_status(kind, client, self.timeout_s)
            except Exception as exc:  # refused, reset, 503, UNAVAILABLE: counted, never a wrong answer
                outcome = Outcome(time.monotonic(), kind.name, ok=False, error=f"{type(exc).__name__}: {exc}"[:300],
                                  started=started, caller=caller)
            else:
                right = answer == self.expected[kind.name]
                outcome = Outcome(time.monotonic(), kind.name, ok=right, wrong=not right,
                                  error="" if right else f"wrong answer: {answer[:120]!r}",
                                  started=started, caller=caller,
                                  hit=right and status.startswith("meshcache; hit"))
            with self._lock:
                self.outcomes.append(outcome)
            self._stop.wait(self.pause_s)

    def start(self) -> Load:
        for n in range(self.threads):
            t = threading.Thread(target=self._run, args=(n,), daemon=True)
            t.start()
            self._workers.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._workers:
            t.join(timeout=15)

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def hits(self) -> int:
        with self._lock:
            return sum(o.hit for o in self.outcomes)

    def failed(self) -> list[Outcome]:
        """Every request not answered right: errors and wrong answers."""
        with self._lock:
            return [o for o in self.outcomes if not o.ok]

    def wait_hits(self, more_than: int, timeout: float = 10.0) -> None:
        """Wait until more than `more_than` hits have been served in all."""
        try:
            eventually(lambda: self.hits > more_than, timeout=timeout)
        except AssertionError:
            raise AssertionError(f"no hits served ({len(self.outcomes)} answers, {self.failed()[:3]})") from None

    def between(self, start: float, end: float, where: Callable[[Outcome], bool] = lambda _: True
                ) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if start <= o.at < end and where(o)]

    def wait_answered(self, since: float, times: int = 1, timeout: float = 30.0) -> float:
        """Wait until every caller has had every kind answered right `times` times by requests it
        sent at or after `since` (its earlier requests have then ended too: each caller sends one
        at a time); returns when. Fails naming the (caller, kind) pairs still short."""
        def answered() -> float:
            with self._lock:
                right = Counter((o.caller, o.kind) for o in self.outcomes if o.ok and o.started >= since)
            short = [(c, k.name) for c in range(self.threads) for k in self.kinds if right[(c, k.name)] < times]
            assert not short, f"not yet answered right {times}x since {since:.2f}: {short}"
            return time.monotonic()

        return eventually(answered, timeout)
