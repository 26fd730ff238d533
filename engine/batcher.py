"""The scheduler of one model version: requests queue by priority and run on onnxruntime, with
Triton's dynamic batching when the config has it.

A model version runs at most `instances` onnxruntime calls at a time (Triton's instance_group
count), each on its own thread. When an instance is free, the highest-priority request is taken;
with dynamic batching, as in Triton, the largest preferred batch size the queue can form runs at
once; if none can be formed, the dispatch waits up to max_queue_delay_microseconds after the oldest
queued request for more rows (or until max_batch_size rows are queued), then every compatible
request that fits runs as one call and each request gets its own rows back. Requests are
compatible when their non-batch shapes are equal.

Priorities follow Triton: with priority_levels N, level 1 runs first and N last; a request without a
priority (0) or with one out of range gets default_priority_level; without priority_levels all
requests are equal (first come, first served). A queue timeout (default_queue_policy) is checked at
each scheduling decision: REJECT answers the expired request with an error, DELAY moves it behind
every request that has not expired.

Scheduling is callback-driven on the event loop rather than a worker task: a request that finds
an instance idle goes to the onnxruntime thread straight from `submit`, and the thread hands the
results back in a single loop callback that resolves the callers' futures directly. Each hop
between threads costs tens of microseconds, more on a busy machine, and that is per-request
overhead on top of the model. So when a lone request finds nothing else queued and the model's
runs are short (INLINE_MAX_SECONDS), a single-instance model runs it on the event loop thread: no
hop at all, and no one is kept waiting who could have run meanwhile (the one instance is busy
either way). Requests that arrive meanwhile are read when the run ends, as they would have queued.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from meshcache.engine.errors import QueueFull, QueueTimeout, Unavailable
from meshcache.engine.metrics import EngineMetrics
from meshcache.engine.repository import LoadedModel

Tensors = dict[str, np.ndarray]
# Runs up to this long (moving average) may run on the event loop when the queue is otherwise empty.
INLINE_MAX_SECONDS = 0.01


@dataclass(order=True)
class _Pending:
    # (expired under DELAY, priority level, arrival order)
    sort_key: tuple[int, int, int]
    rows: int = field(compare=False)
    feeds: Tensors = field(compare=False)
    # Non-batch shapes of every input: only equal signatures can be concatenated.
    signature: tuple[tuple[int, ...], ...] = field(compare=False)
    future: asyncio.Future[Tensors] = field(compare=False)
    enqueued: float = field(compare=False)
    deadline: float | None = field(compare=False)


class Batcher:
    def __init__(self, model: LoadedModel, metrics: EngineMetrics) -> None:
        cfg = model.config
        b = cfg.batching
        self.model = model
        self.stats = model.stats
        self.dynamic = b.dynamic
        self.counts_rows = cfg.max_batch_size > 0
        self.max_rows = max(cfg.max_batch_size, 1)
        self.delay = b.max_queue_delay_us / 1e6 if self.dynamic else 0.0
        self.preferred = tuple(sorted(b.preferred_batch_sizes))
        self.max_queue = b.max_queue_size
        self.levels = b.priority_levels
        self.default_level = b.default_priority_level
        self.timeout_us = b.timeout_us
        self.allow_timeout_override = b.allow_timeout_override
        self.delay_on_timeout = b.delay_on_timeout
        self.instances = cfg.instances
        self.executor = ThreadPoolExecutor(max_workers=self.instances, thread_name_prefix=f"ort-{cfg.name}")
        self._heap: list[_Pending] = []
        self._queued_rows = 0
        self._deadlines = 0  # queued requests with a deadline: the expiry scan runs only when > 0
        self._seq = itertools.count()
        self._running = 0
        self._stopped = False
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        # Moving average of onnxruntime run time; None until the first run (which uses the thread).
        self._run_seconds: float | None = None
        # Bound once: label lookups in prometheus_client take a lock and a dict lookup per call.
        self._queue_time = metrics.queue_time.labels(cfg.name)
        self._batch_size = metrics.batch_size.labels(cfg.name)
        metrics.pending.labels(cfg.name).set_function(lambda: len(self._heap))

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def drain(self, timeout: float) -> bool:
        """Waits until nothing is queued or running (for an unload or a reload)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for item in self._heap:
            if not item.future.done():
                item.future.set_exception(Unavailable("engine is shutting down"))
        self._heap.clear()
        self._queued_rows = 0
        self.executor.shutdown(wait=False)

    def _level(self, priority: int) -> int:
        if not self.levels:
            return 0
        return priority if 1 <= priority <= self.levels else self.default_level

    def _deadline(self, now: float, timeout_us: int) -> float | None:
        timeout = self.timeout_us
        if timeout_us and self.allow_timeout_override:
            # A request may shorten the model's timeout, never lengthen it (as in Triton).
            timeout = min(timeout, timeout_us) if timeout else timeout_us
        return now + timeout / 1e6 if timeout else None

    async def submit(self, feeds: Tensors, priority: int = 0, timeout_us: int = 0) -> Tensors:
        """Queue one validated request; its outputs come back with its own rows only."""
        if self._stopped:
            raise Unavailable(f"model {self.model.config.name!r} is being unloaded")
        if len(self._heap) >= self.max_queue:
            raise QueueFull(
                f"model {self.model.config.name!r} queue is full ({self.max_queue} requests waiting)"
            )
        if self.counts_rows:
            rows = int(next(iter(feeds.values())).shape[0])
            signature = tuple(a.shape[1:] for a in feeds.values())
        else:
            rows, signature = 1, tuple(a.shape for a in feeds.values())
        assert self._loop is not None, "Batcher.start() was not called"
        future: asyncio.Future[Tensors] = self._loop.create_future()
        now = time.perf_counter()
        deadline = self._deadline(now, timeout_us)
        pending = _Pending((0, self._level(priority), next(self._seq)), rows, feeds, signature, future, now,
                           deadline)
        heapq.heappush(self._heap, pending)
        self._queued_rows += rows
        if deadline is not None:
            self._deadlines += 1
        self._idle.clear()
        self._dispatch()
        return await future

    def _expire(self, now: float) -> None:
        """Applies the timeout action to every queued request past its deadline."""
        kept: list[_Pending] = []
        for item in self._heap:
            if item.deadline is None or item.deadline > now:
                kept.append(item)
                continue
            item.deadline = None
            self._deadlines -= 1
            if self.delay_on_timeout:
                item.sort_key = (1, *item.sort_key[1:])
                kept.append(item)
                continue
            self._queued_rows -= item.rows
            if not item.future.done():
                item.future.set_exception(QueueTimeout(
                    f"model {self.model.config.name!r}: request timed out after waiting "
                    f"{(now - item.enqueued) * 1e3:.1f} ms in the queue"))
        if len(kept) != len(self._heap) or self.delay_on_timeout:
            heapq.heapify(kept)
            self._heap = kept

    def _dispatch(self) -> None:
        """Start batches while an instance is idle and the queue is ready; else arm a timer."""
        while self._running < self.instances and not self._stopped:
            if self._deadlines:
                self._expire(time.perf_counter())
            if not self._heap:
                break
            limit = self.max_rows
            if self.dynamic:
                # Triton's rule: the largest preferred batch size that the queue can form goes at
                # once; if none can be formed, wait up to the delay for more, then send what there is.
                formed = [size for size in self.preferred if size <= self._queued_rows]
                if formed:
                    limit = formed[-1]
                elif self.delay > 0 and self._queued_rows < self.max_rows:
                    remaining = min(item.enqueued for item in self._heap) + self.delay - time.perf_counter()
                    if remaining > 0:
                        if self._timer is None:
                            assert self._loop is not None
                            self._timer = self._loop.call_later(remaining, self._on_timer)
                        return
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            batch = [item for item in self._take_batch(limit) if not item.future.cancelled()]
            if not batch:
                continue
            now = time.perf_counter()
            for item in batch:
                waited = now - item.enqueued
                self._queue_time.observe(waited)
                self.stats.queue.add(int(waited * 1e9))
            self._running += 1
            if (len(batch) == 1 and not self._heap and self.instances == 1 and self._run_seconds is not None
                    and self._run_seconds <= INLINE_MAX_SECONDS):
                self._finish(batch, self._outcome(batch))
            else:
                self.executor.submit(self._execute, batch)
        if not self._running and not self._heap:
            self._idle.set()

    def _on_timer(self) -> None:
        self._timer = None
        self._dispatch()

    def _take_batch(self, limit: int) -> list[_Pending]:
        head = heapq.heappop(self._heap)
        batch, rows, skipped = [head], head.rows, []
        while self._heap and rows < limit and self.dynamic:
            item = heapq.heappop(self._heap)
            if item.signature != head.signature or rows + item.rows > limit:
                skipped.append(item)
                continue
            batch.append(item)
            rows += item.rows
        for item in skipped:
            heapq.heappush(self._heap, item)
        for item in batch:
            self._queued_rows -= item.rows
            if item.deadline is not None:
                self._deadlines -= 1
        return batch

    def _outcome(self, batch: list[_Pending]) -> tuple[list[Tensors], int, int, int] | BaseException:
        try:
            return self._run(batch)
        except Exception as exc:  # onnxruntime failure: fail this batch, keep serving
            return exc

    def _execute(self, batch: list[_Pending]) -> None:
        """On an onnxruntime thread: run the batch, then hand every answer back in one callback."""
        outcome = self._outcome(batch)
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._finish, batch, outcome)
        except RuntimeError:  # the loop closed during shutdown; nobody is waiting any more
            pass

    def _finish(self, batch: list[_Pending], outcome: tuple[list[Tensors], int, int, int] | BaseException) -> None:
        self._running -= 1
        if isinstance(outcome, BaseException):
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(outcome)
        else:
            results, input_ns, infer_ns, output_ns = outcome
            seconds = infer_ns / 1e9
            self._run_seconds = seconds if self._run_seconds is None else 0.8 * self._run_seconds + 0.2 * seconds
            self.stats.batch_done(sum(item.rows for item in batch), len(batch), input_ns, infer_ns, output_ns)
            for item, result in zip(batch, results, strict=True):
                if not item.future.done():  # the caller went away
                    item.future.set_result(result)
        self._dispatch()

    def _run(self, batch: list[_Pending]) -> tuple[list[Tensors], int, int, int]:
        rows = sum(item.rows for item in batch)
        self._batch_size.observe(rows)
        t0 = time.perf_counter_ns()
        if len(batch) == 1:
            feeds = batch[0].feeds
            t1 = time.perf_counter_ns()
            results = [self.model.run(feeds)]
            t2 = time.perf_counter_ns()
            return results, t1 - t0, t2 - t1, 0
        names = list(batch[0].feeds)
        feeds = {n: np.concatenate([item.feeds[n] for item in batch]) for n in names}
        t1 = time.perf_counter_ns()
        outputs = self.model.run(feeds)
        t2 = time.perf_counter_ns()
        results, offset = [], 0
        for item in batch:
            results.append({n: out[offset:offset + item.rows] for n, out in outputs.items()})
            offset += item.rows
        return results, t1 - t0, t2 - t1, time.perf_counter_ns() - t2
