"""The transport-independent engine: model lookup, input validation, batching, draining, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from prometheus_client import Counter, Histogram

from engine.batcher import Batcher, Tensors
from engine.errors import EngineError, InvalidInput, Unavailable
from engine.metrics import EngineMetrics
from engine.models import LoadedModel, ModelRepository, TensorSpec
from engine.tensors import DATATYPE_OF

SERVER_NAME = "meshcache-engine"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ["binary_tensor_data"]
# Bounds the accepted priority so it cannot be abused to overflow sort keys.
MAX_PRIORITY = 2**31 - 1


def parse_priority(value: object) -> int:
    if value is None or value == "":
        return 0
    try:
        priority = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise InvalidInput(f"priority must be an integer, got {value!r}") from None
    if isinstance(value, float) and value != priority:
        raise InvalidInput(f"priority must be an integer, got {value!r}")
    if abs(priority) > MAX_PRIORITY:
        raise InvalidInput(f"priority must lie in -{MAX_PRIORITY}..{MAX_PRIORITY}")
    return priority


class InferenceService:
    def __init__(self, repository: ModelRepository, metrics: EngineMetrics) -> None:
        self.repository = repository
        self.metrics = metrics
        models = repository.all_models()
        # One thread per model version: each runs at most one batch at a time.
        self.executor = ThreadPoolExecutor(max_workers=len(models), thread_name_prefix="ort")
        self.batchers = {id(m): Batcher(m, self.executor, metrics) for m in models}
        # (model label, protocol) -> bound request counter and latency histogram. prometheus_client's
        # labels() takes a lock and builds a key on every call; binding once saves that per request.
        self._request_metrics: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self) -> None:
        for batcher in self.batchers.values():
            batcher.start()

    async def stop(self) -> None:
        for batcher in self.batchers.values():
            await batcher.stop()
        self.executor.shutdown(wait=True)

    @property
    def ready(self) -> bool:
        return not self.draining

    def begin_drain(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    @contextlib.asynccontextmanager
    async def request(self, model_label: str, protocol: str) -> AsyncIterator[None]:
        """Accounts one request: refused while draining, counted in metrics and in-flight."""
        label = model_label if model_label in self.repository.models else "_unknown"
        bound = self._request_metrics.get((label, protocol))
        if bound is None:
            bound = (self.metrics.requests.labels(label, protocol), self.metrics.latency.labels(label, protocol))
            self._request_metrics[(label, protocol)] = bound
        requests, latency = bound
        requests.inc()
        started = time.perf_counter()
        if self.draining:
            self.metrics.failures.labels(label, protocol, Unavailable.reason).inc()
            raise Unavailable("engine is shutting down")
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        except EngineError as exc:
            self.metrics.failures.labels(label, protocol, exc.reason).inc()
            raise
        except Exception:
            self.metrics.failures.labels(label, protocol, "internal").inc()
            raise
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()
            latency.observe(time.perf_counter() - started)

    def validate(self, model: LoadedModel, inputs: Tensors, requested: list[str] | None) -> list[str]:
        """Checks names, datatypes and shapes against the config; returns the outputs to send."""
        cfg = model.config
        expected = {s.name: s for s in cfg.inputs}
        for name in inputs:
            if name not in expected:
                raise InvalidInput(
                    f"model {cfg.name!r} has no input {name!r}; inputs: {', '.join(expected)}"
                )
        for spec in cfg.inputs:
            if spec.name not in inputs:
                raise InvalidInput(f"input {spec.name!r} is missing; expected {self._describe(model, spec)}")
            self._check_tensor(model, spec, inputs[spec.name])
        if cfg.max_batch_size > 0:
            batch_sizes = {a.shape[0] for a in inputs.values()}
            if len(batch_sizes) > 1:
                raise InvalidInput(f"inputs disagree on the batch dimension: {sorted(batch_sizes)}")
        outputs = [s.name for s in cfg.outputs]
        if not requested:
            return outputs
        for name in requested:
            if name not in outputs:
                raise InvalidInput(
                    f"model {cfg.name!r} has no output {name!r}; outputs: {', '.join(outputs)}"
                )
        return requested

    @staticmethod
    def _describe(model: LoadedModel, spec: TensorSpec) -> str:
        return f"{spec.datatype} with shape {model.config.full_shape(spec)}"

    def _check_tensor(self, model: LoadedModel, spec: TensorSpec, array: np.ndarray) -> None:
        cfg = model.config
        if array.dtype != spec.dtype:
            got = DATATYPE_OF.get(array.dtype, str(array.dtype))
            raise InvalidInput(f"input {spec.name!r}: got datatype {got}, expected {spec.datatype}")
        shape = array.shape
        dims = list(shape[1:]) if cfg.max_batch_size > 0 else list(shape)
        ok = len(dims) == len(spec.shape) and all(e in (-1, d) for e, d in zip(spec.shape, dims, strict=True))
        ok = ok and all(d > 0 for d in shape)
        if cfg.max_batch_size > 0:
            ok = ok and len(shape) >= 1 and 1 <= shape[0] <= cfg.max_batch_size
        if not ok:
            limit = f" (batch dimension 1..{cfg.max_batch_size})" if cfg.max_batch_size > 0 else ""
            raise InvalidInput(
                f"input {spec.name!r}: got shape {list(shape)}, expected {self._describe(model, spec)}{limit}"
            )

    async def infer(
        self, model: LoadedModel, inputs: Tensors, requested: list[str] | None, priority: int
    ) -> Tensors:
        outputs = self.validate(model, inputs, requested)
        ordered = {s.name: np.ascontiguousarray(inputs[s.name]) for s in model.config.inputs}
        result = await self.batchers[id(model)].submit(ordered, priority)
        return {name: result[name] for name in outputs}

