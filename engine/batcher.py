"""Dynamic batching: requests for one model version queue by priority and run together.

A worker task per model version takes the highest-priority request, waits up to
max_queue_delay_us for more rows (or until the largest preferred batch size is queued), then runs
every compatible request it can fit in max_batch_size rows as one onnxruntime call and hands each
request its own rows back. Requests are compatible when their non-batch shapes are equal.
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
        self.metrics = metrics
        self.batches = cfg.max_batch_size > 0
        self.max_rows = max(cfg.max_batch_size, 1)
        self.delay = cfg.batching.max_queue_delay_us / 1e6
        # Enough rows to stop waiting out the delay.
        self.dispatch_rows = max(cfg.batching.preferred_batch_sizes, default=self.max_rows)
        self.max_queue = cfg.batching.max_queue_size
        self._heap: list[_Pending] = []
        self._queued_rows = 0
        self._seq = itertools.count()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._label = f"{cfg.name}"

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._work(), name=f"batcher-{self._label}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for item in self._heap:
            if not item.future.done():
                item.future.set_exception(Unavailable("engine is shutting down"))
        self._heap.clear()

    async def submit(self, feeds: Tensors, priority: int = 0) -> Tensors:
        """Queue one validated request; its outputs come back with its own rows only."""
        if len(self._heap) >= self.max_queue:
            raise QueueFull(
                f"model {self.model.config.name!r} queue is full ({self.max_queue} requests waiting)"
            )
        first = next(iter(feeds.values()))
        rows = int(first.shape[0]) if self.batches else 1
        signature = tuple(a.shape[1:] if self.batches else a.shape for a in feeds.values())
        future: asyncio.Future[Tensors] = asyncio.get_running_loop().create_future()
        pending = _Pending((-priority, next(self._seq)), rows, feeds, signature, future, time.perf_counter())
        heapq.heappush(self._heap, pending)
        self._queued_rows += rows
        self._wakeup.set()
        return await future

    async def _wait_for_rows(self, oldest: float) -> None:
        deadline = oldest + self.delay
        while self._queued_rows < self.dispatch_rows:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                return

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
        self._queued_rows -= rows
        return batch

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._heap:
                self._wakeup.clear()
                await self._wakeup.wait()
            if self.batches and self.delay > 0:
                await self._wait_for_rows(min(item.enqueued for item in self._heap))
            batch = [item for item in self._take_batch() if not item.future.cancelled()]
            if not batch:
                continue
            now = time.perf_counter()
            for item in batch:
                self.metrics.queue_time.labels(self._label).observe(now - item.enqueued)
            try:
                outputs = await loop.run_in_executor(self.executor, self._run, batch)
            except Exception as exc:  # onnxruntime failure: fail this batch, keep serving
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(exc)
                continue
            for item, result in zip(batch, outputs, strict=True):
                if not item.future.done():
                    item.future.set_result(result)

    def _run(self, batch: list[_Pending]) -> list[Tensors]:
        rows = sum(item.rows for item in batch)
        self.metrics.batch_size.labels(self._label).observe(rows)
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
