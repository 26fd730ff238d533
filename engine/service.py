"""The transport-independent engine: model lookup, input validation, batching, draining, metrics,
Triton statistics and the model repository (load/unload while serving)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping

import numpy as np
from prometheus_client import Counter, Histogram

from meshcache.contract.protos import grpc_predict_v2_pb2 as pb
from meshcache.contract.protos import model_config_pb2 as mc
from meshcache.engine import model_config
from meshcache.engine.batcher import Batcher, Tensors
from meshcache.engine.errors import EngineError, InvalidInput, NotFound, Unavailable
from meshcache.engine.metrics import EngineMetrics
from meshcache.engine.model_config import ConfigError
from meshcache.engine.repository import LoadedModel, ModelEntry, ModelRepository, TensorSpec
from meshcache.engine.tensors import DATATYPE_OF

SERVER_NAME = "meshcache-engine"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics", "model_repository",
              "model_repository(unload_dependents)"]
# Triton priorities and timeouts are uint64; bounded so they cannot overflow sort keys.
MAX_PRIORITY = 2**31 - 1
MAX_TIMEOUT_US = 2**53


def _request_int(value: object, what: str, limit: int) -> int:
    if value is None or value == "":
        return 0
    try:
        number = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise InvalidInput(f"{what} must be an integer, got {value!r}") from None
    if isinstance(value, bool) or (isinstance(value, float) and value != number):
        raise InvalidInput(f"{what} must be an integer, got {value!r}")
    if not 0 <= number <= limit:
        raise InvalidInput(f"{what} must lie in 0..{limit}, got {number}")
    return number


def parse_priority(value: object) -> int:
    """Triton's request priority: 1 is the highest level; 0 (or none) the model's default."""
    return _request_int(value, "priority", MAX_PRIORITY)


def parse_timeout(value: object) -> int:
    """Triton's request "timeout" parameter, microseconds (honoured when the model allows it)."""
    return _request_int(value, "timeout", MAX_TIMEOUT_US)


class Call:
    """One inference request being served: which model it resolved to, for the statistics."""

    __slots__ = ("service", "name", "model", "rows")

    def __init__(self, service: InferenceService, name: str) -> None:
        self.service, self.name = service, name
        self.model: LoadedModel | None = None
        self.rows = 0

    def resolve(self, version: str) -> LoadedModel:
        self.model = self.service.repository.get(self.name, version)
        return self.model


class InferenceService:
    def __init__(self, repository: ModelRepository, metrics: EngineMetrics, allow_model_control: bool = True,
                 unload_grace_seconds: float = 30.0) -> None:
        self.repository = repository
        self.metrics = metrics
        self.allow_model_control = allow_model_control
        self.unload_grace_seconds = unload_grace_seconds
        self.batchers: dict[LoadedModel, Batcher] = {}
        self._started = False
        for entry in repository.models.values():
            self._add_batchers(entry)
        # (model label, protocol) -> bound request counter and latency histogram. prometheus_client's
        # labels() takes a lock and builds a key on every call; binding once saves that per request.
        self._request_metrics: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._load_lock = asyncio.Lock()

    def _add_batchers(self, entry: ModelEntry) -> None:
        for model in entry.versions.values():
            batcher = Batcher(model, self.metrics)
            if self._started:
                batcher.start()
            self.batchers[model] = batcher

    def start(self) -> None:
        self._started = True
        for batcher in self.batchers.values():
            batcher.start()

    async def stop(self) -> None:
        for batcher in self.batchers.values():
            await batcher.stop()

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
    async def request(self, model_label: str, protocol: str) -> AsyncIterator[Call]:
        """Accounts one request: refused while draining, counted in metrics, statistics and in-flight."""
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
        call = Call(self, model_label)
        ok = False
        try:
            yield call
            ok = True
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
            elapsed = time.perf_counter() - started
            latency.observe(elapsed)
            if call.model is not None:
                call.model.stats.request_done(ok, int(elapsed * 1e9), call.rows)

    # ---- Triton extensions: statistics and the model repository ----------------------------

    def statistics(self, name: str, version: str) -> list[pb.ModelStatistics]:
        if not name:
            if version:
                raise InvalidInput("statistics for a version need the model name")
            return [m.stats.to_proto(m.config.name, m.version) for m in self.repository.all_models()]
        if version:
            model = self.repository.get(name, version)
            return [model.stats.to_proto(name, model.version)]
        entry = self.repository.entry(name)
        return [entry.versions[v].stats.to_proto(name, v) for v in entry.sorted_versions()]

    def index(self, ready_only: bool) -> list[pb.RepositoryIndexResponse.ModelIndex]:
        out = []
        names = set(self.repository.models) | set(self.repository.unavailable)
        if not ready_only:
            names |= set(ModelRepository.names_on_disk(self.repository.directory))
        for name in sorted(names):
            entry = self.repository.models.get(name)
            if entry is not None:
                out += [pb.RepositoryIndexResponse.ModelIndex(name=name, version=v, state="READY")
                        for v in entry.sorted_versions()]
            elif not ready_only:
                reason = self.repository.unavailable.get(name, "not loaded")
                out.append(pb.RepositoryIndexResponse.ModelIndex(name=name, state="UNAVAILABLE", reason=reason))
        return out

    def _check_control(self, repository_name: str) -> None:
        if not self.allow_model_control:
            raise Unavailable("explicit model load / unload is not allowed (--model-control-mode none)")
        if repository_name not in ("", self.repository.directory.name, str(self.repository.directory)):
            raise NotFound(f"unknown repository {repository_name!r}; the engine serves "
                           f"{self.repository.directory}")

    def model_ready(self, name: str, version: str) -> bool:
        """Whether the model takes requests (NotFound when it is not served)."""
        self.repository.get(name, version)
        return self.ready

    def model_metadata(self, name: str, version: str) -> pb.ModelMetadataResponse:
        """KServe v2 model metadata; `versions` is the asked version, or every served one."""
        model = self.repository.get(name, version)
        cfg = model.config
        meta = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=cfg.name,
            versions=[model.version] if version else self.repository.entry(cfg.name).sorted_versions(),
            platform=cfg.platform,
            inputs=[meta(name=s.name, datatype=s.datatype, shape=cfg.full_shape(s)) for s in cfg.inputs],
            outputs=[meta(name=s.name, datatype=s.datatype, shape=cfg.full_shape(s)) for s in cfg.outputs],
        )

    async def load(self, name: str, parameters: Mapping[str, object], repository_name: str = "") -> None:
        """Triton's RepositoryModelLoad: `parameters` as plain values (the one supported,
        `config`, is a JSON ModelConfig string that overrides config.pbtxt)."""
        for key in parameters:
            if key != "config":
                raise InvalidInput(f"load parameter {key!r} is not supported; supported: 'config' "
                                   f"(JSON ModelConfig)")
        config = parameters.get("config")
        if "config" in parameters and not isinstance(config, str):
            raise InvalidInput("load parameter 'config' must be a string holding a JSON ModelConfig")
        await self._load(name, config if isinstance(config, str) else None, repository_name)

    async def unload(self, name: str, parameters: Mapping[str, object], repository_name: str = "") -> None:
        """Triton's RepositoryModelUnload; `unload_dependents` (bool) is accepted: the engine has
        no ensembles, so there are never dependents to unload."""
        for key, value in parameters.items():
            if key != "unload_dependents" or not isinstance(value, bool):
                raise InvalidInput(f"unload parameter {key!r} is not supported; supported: "
                                   f"'unload_dependents' (bool)")
        await self._unload(name, repository_name)

    async def _load(self, name: str, config_json: str | None = None, repository_name: str = "") -> None:
        """Loads (or reloads) a model from the repository directory without a restart. A failed
        reload keeps the served versions; a successful one swaps them once the new ones are ready."""
        self._check_control(repository_name)
        async with self._load_lock:
            try:
                override = (None if config_json is None
                            else model_config.parse_json(config_json, f"{name}: load parameter 'config'"))
                entry = await asyncio.to_thread(self.repository.read, name, override)
            except ConfigError as exc:
                if name not in self.repository.models:
                    self.repository.unavailable[name] = str(exc)
                raise InvalidInput(f"failed to load {name!r}: {exc}") from None
            self._add_batchers(entry)
            old = self.repository.models.get(name)
            self.repository.models[name] = entry
            self.repository.unavailable.pop(name, None)
            if old is not None:
                await self._retire(old)

    async def _unload(self, name: str, repository_name: str = "") -> None:
        """Stops serving a model: new requests are refused at once, queued ones still finish."""
        self._check_control(repository_name)
        async with self._load_lock:
            entry = self.repository.entry(name)
            del self.repository.models[name]
            self.repository.unavailable[name] = "unloaded"
            await self._retire(entry)

    async def _retire(self, entry: ModelEntry) -> None:
        for model in entry.versions.values():
            batcher = self.batchers.pop(model)
            await batcher.drain(self.unload_grace_seconds)
            await batcher.stop()

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

    async def infer(self, call: Call, model: LoadedModel, inputs: Tensors, requested: list[str] | None,
                    priority: int, timeout_us: int = 0) -> Tensors:
        outputs = self.validate(model, inputs, requested)
        ordered = {s.name: np.ascontiguousarray(inputs[s.name]) for s in model.config.inputs}
        batcher = self.batchers.get(model)
        if batcher is None:
            raise Unavailable(f"model {model.config.name!r} version {model.version} was unloaded")
        call.rows = int(next(iter(ordered.values())).shape[0]) if model.config.max_batch_size > 0 else 1
        result = await batcher.submit(ordered, priority, timeout_us)
        return {name: result[name] for name in outputs}

    def config_of(self, name: str, version: str) -> mc.ModelConfig:
        return self.repository.get(name, version).config.proto

