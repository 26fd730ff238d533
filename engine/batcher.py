"""Dynamic batching: requests for one model version queue by priority and run together.

Each model version runs at most one onnxruntime call at a time. When it is free, the
highest-priority request is taken; with batching enabled the dispatch waits up to
max_queue_delay_us after the oldest queued request for more rows (or until the largest preferred
batch size is queued), then every compatible request that fits in max_batch_size rows runs as one
call and each request gets its own rows back. Requests are compatible when their non-batch shapes
are equal.

Scheduling is callback-driven on the event loop rather than a worker task: a request that finds
the model idle goes to the onnxruntime thread straight from `submit`, and the thread hands the
results back in a single loop callback that resolves the callers' futures directly. Each hop
through the loop costs tens of microseconds, more on a busy machine, and that is per-request
overhead on top of the model.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from engine.errors import QueueFull, Unavailable
from engine.metrics import EngineMetrics
from engine.models import LoadedModel

Tensors = dict[str, np.ndarray]


@dataclass(order=True)
class _Pending:
    sort_key: tuple[int, int]
    rows: int = field(compare=False)
    feeds: Tensors = field(compare=False)
    # Non-batch shapes of every input: only equal signatures can be concatenated.
    signature: tuple[tuple[int, ...], ...] = field(compare=False)
    future: asyncio.Future[Tensors] = field(compare=False)
    enqueued: float = field(compare=False)


class Batcher:
    def __init__(self, model: LoadedModel, executor: Executor, metrics: EngineMetrics) -> None:
        cfg = model.config
        self.model = model
        self.executor = executor
        self.batches = cfg.max_batch_size > 0
        self.max_rows = max(cfg.max_batch_size, 1)
        self.delay = cfg.batching.max_queue_delay_us / 1e6 if self.batches else 0.0
        # Enough rows to stop waiting out the delay.
        self.dispatch_rows = max(cfg.batching.preferred_batch_sizes, default=self.max_rows)
        self.max_queue = cfg.batching.max_queue_size
        self._heap: list[_Pending] = []
        self._queued_rows = 0
        self._seq = itertools.count()
        self._running = False
        self._stopped = False
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Bound once: label lookups in prometheus_client take a lock and a dict lookup per call.
        self._queue_time = metrics.queue_time.labels(cfg.name)
        self._batch_size = metrics.batch_size.labels(cfg.name)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

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

    async def submit(self, feeds: Tensors, priority: int = 0) -> Tensors:
        """Queue one validated request; its outputs come back with its own rows only."""
        if self._stopped:
            raise Unavailable("engine is shutting down")
        if len(self._heap) >= self.max_queue:
            raise QueueFull(
                f"model {self.model.config.name!r} queue is full ({self.max_queue} requests waiting)"
            )
        first = next(iter(feeds.values()))
        rows = int(first.shape[0]) if self.batches else 1
        signature = tuple(a.shape[1:] if self.batches else a.shape for a in feeds.values())
        assert self._loop is not None, "Batcher.start() was not called"
        future: asyncio.Future[Tensors] = self._loop.create_future()
        pending = _Pending((-priority, next(self._seq)), rows, feeds, signature, future, time.perf_counter())
        heapq.heappush(self._heap, pending)
        self._queued_rows += rows
        self._dispatch()
        return await future

    def _dispatch(self) -> None:
        """Start the next batch if the model is idle and the queue is ready; else arm a timer."""
        if self._running or self._stopped or not self._heap:
            return
        if self.delay > 0 and self._queued_rows < self.dispatch_rows:
            remaining = min(item.enqueued for item in self._heap) + self.delay - time.perf_counter()
            if remaining > 0:
                if self._timer is None:
                    assert self._loop is not None
                    self._timer = self._loop.call_later(remaining, self._on_timer)
                return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch = [item for item in self._take_batch() if not item.future.cancelled()]
        if not batch:
            self._dispatch()
            return
        now = time.perf_counter()
        for item in batch:
            self._queue_time.observe(now - item.enqueued)
        self._running = True
        self.executor.submit(self._execute, batch)

    def _on_timer(self) -> None:
        self._timer = None
        self._dispatch()

    def _take_batch(self) -> list[_Pending]:
        head = heapq.heappop(self._heap)
        batch, rows, skipped = [head], head.rows, []
        while self._heap and rows < self.max_rows and self.batches:
            item = heapq.heappop(self._heap)
            if item.signature != head.signature or rows + item.rows > self.max_rows:
                skipped.append(item)
                continue
            batch.append(item)
            rows += item.rows
        for item in skipped:
            heapq.heappush(self._heap, item)
        self._queued_rows -= sum(item.rows for item in batch)
        return batch

    def _execute(self, batch: list[_Pending]) -> None:
        """On the onnxruntime thread: run the batch, then hand every answer back in one callback."""
        outcome: list[Tensors] | BaseException
        try:
            outcome = self._run(batch)
        except Exception as exc:  # onnxruntime failure: fail this batch, keep serving
            outcome = exc
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._finish, batch, outcome)
        except RuntimeError:  # the loop closed during shutdown; nobody is waiting any more
            pass

    def _finish(self, batch: list[_Pending], outcome: list[Tensors] | BaseException) -> None:
        self._running = False
        for i, item in enumerate(batch):
            if item.future.done():  # the caller went away
                continue
            if isinstance(outcome, BaseException):
                item.future.set_exception(outcome)
            else:
                item.future.set_result(outcome[i])
        self._dispatch()

    def _run(self, batch: list[_Pending]) -> list[Tensors]:
        rows = sum(item.rows for item in batch)
        self._batch_size.observe(rows)
        if len(batch) == 1:
            return [self.model.run(batch[0].feeds)]
        names = list(batch[0].feeds)
        feeds = {n: np.concatenate([item.feeds[n] for item in batch]) for n in names}
        outputs = self.model.run(feeds)
        results, offset = [], 0
        for item in batch:
            results.append({n: out[offset:offset + item.rows] for n, out in outputs.items()})
            offset += item.rows
        return results
