"""The KServe v2 gRPC transport (inference.GRPCInferenceService) on grpc.aio, with Triton's
extensions: ModelStreamInfer, ModelConfig, ModelStatistics, RepositoryIndex and
RepositoryModelLoad/Unload.

Requests arrive as raw bytes and are parsed here, so a malformed protobuf is answered with
INVALID_ARGUMENT instead of grpcio's generic deserialization error.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from meshcache.contract.protos import grpc_predict_v2_pb2 as pb
from meshcache.engine import tensors
from meshcache.engine.errors import EngineError, InvalidInput
from meshcache.engine.repository import LoadedModel
from meshcache.engine.service import (
    EXTENSIONS,
    SERVER_NAME,
    SERVER_VERSION,
    InferenceService,
    parse_priority,
    parse_timeout,
)

SERVICE = "inference.GRPCInferenceService"
# Requests of one ModelStreamInfer stream served at the same time; the stream reads no further
# requests while that many are in flight (HTTP/2 flow control then holds the client).
STREAM_IN_FLIGHT = 256


def _param_value(param: pb.InferParameter | pb.ModelRepositoryParameter) -> object:
    choice = param.WhichOneof("parameter_choice")
    return None if choice is None else getattr(param, choice)


def _param_values(params: Mapping[str, pb.ModelRepositoryParameter]) -> dict[str, object]:
    return {key: _param_value(param) for key, param in params.items()}


class GrpcInferenceServicer:
    def __init__(self, service: InferenceService) -> None:
        self.service = service

    async def server_live(self, request: pb.ServerLiveRequest) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request: pb.ServerReadyRequest) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.service.ready)

    async def model_ready(self, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=self.service.model_ready(request.name, request.version))

    async def server_metadata(self, request: pb.ServerMetadataRequest) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=EXTENSIONS)

    async def model_metadata(self, request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:
        return self.service.model_metadata(request.name, request.version)

    async def model_infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        async with self.service.request(request.model_name, "grpc") as call:
            model = call.resolve(request.model_version)
            params = request.parameters
            priority = parse_priority(_param_value(params["priority"]) if "priority" in params else None)
            timeout = parse_timeout(_param_value(params["timeout"]) if "timeout" in params else None)
            raw = request.raw_input_contents
            if raw and len(raw) != len(request.inputs):
                raise InvalidInput(f"raw_input_contents has {len(raw)} entries, "
                                   f"expected one per input ({len(request.inputs)})")
            inputs = {}
            for i, tensor in enumerate(request.inputs):
                shape = tuple(tensor.shape)
                if any(d < 0 for d in shape):
                    raise InvalidInput(f"input {tensor.name!r}: negative shape {list(shape)}")
                if tensor.name in inputs:
                    raise InvalidInput(f"input {tensor.name!r} is given twice")
                name, datatype = tensor.name, tensor.datatype
                if raw:
                    inputs[name] = tensors.from_raw(name, datatype, shape, raw[i])
                else:
                    inputs[name] = tensors.from_contents(name, datatype, shape, tensor.contents)
            requested = [o.name for o in request.outputs] or None
            outputs = await self.service.infer(call, model, inputs, requested, priority, timeout)
            return self._response(request, model, outputs, as_raw=bool(raw))

    async def model_config(self, request: pb.ModelConfigRequest) -> pb.ModelConfigResponse:
        return pb.ModelConfigResponse(config=self.service.config_of(request.name, request.version))

    async def model_statistics(self, request: pb.ModelStatisticsRequest) -> pb.ModelStatisticsResponse:
        return pb.ModelStatisticsResponse(model_stats=self.service.statistics(request.name, request.version))

    async def repository_index(self, request: pb.RepositoryIndexRequest) -> pb.RepositoryIndexResponse:
        return pb.RepositoryIndexResponse(models=self.service.index(request.ready))

    async def repository_model_load(self, request: pb.RepositoryModelLoadRequest) -> pb.RepositoryModelLoadResponse:
        await self.service.load(request.model_name, _param_values(request.parameters), request.repository_name)
        return pb.RepositoryModelLoadResponse()

    async def repository_model_unload(
        self, request: pb.RepositoryModelUnloadRequest
    ) -> pb.RepositoryModelUnloadResponse:
        await self.service.unload(request.model_name, _param_values(request.parameters), request.repository_name)
        return pb.RepositoryModelUnloadResponse()

    async def model_stream_infer(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> None:
        """Each request is served as it arrives and answered when done (in completion order, each
        answer carrying its request's id); a failed one answers with error_message and the stream
        goes on, as in Triton."""
        slots = asyncio.Semaphore(STREAM_IN_FLIGHT)
        write_lock = asyncio.Lock()
        tasks: set[asyncio.Task[None]] = set()

        async def serve(request_bytes: bytes) -> None:
            try:
                try:
                    request = pb.ModelInferRequest.FromString(request_bytes)
                except DecodeError as exc:
                    answer = pb.ModelStreamInferResponse(error_message=f"malformed ModelInferRequest: {exc}")
                else:
                    try:
                        answer = pb.ModelStreamInferResponse(infer_response=await self.model_infer(request))
                    except EngineError as exc:
                        answer = pb.ModelStreamInferResponse(
                            error_message=str(exc), infer_response=pb.ModelInferResponse(
                                model_name=request.model_name, model_version=request.model_version,
                                id=request.id))
                async with write_lock:
                    await context.write(answer.SerializeToString(deterministic=True))
            finally:
                slots.release()

        try:
            async for request_bytes in requests:
                await slots.acquire()
                task = asyncio.create_task(serve(request_bytes))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    @staticmethod
    def _response(
        request: pb.ModelInferRequest, model: LoadedModel, outputs: dict[str, Any], as_raw: bool
    ) -> pb.ModelInferResponse:
        response = pb.ModelInferResponse(
            model_name=model.config.name, model_version=model.version, id=request.id
        )
        for name, array in outputs.items():
            datatype = tensors.DATATYPE_OF[array.dtype]
            out = response.outputs.add(name=name, datatype=datatype, shape=array.shape)
            if as_raw or datatype not in tensors.CONTENTS_FIELD:
                response.raw_output_contents.append(tensors.to_raw(array))
            else:
                tensors.fill_contents(out.contents, datatype, array)
        return response


def _unary(
    handler: Callable[[Any], Awaitable[Message]], request_type: type[Message]
) -> grpc.RpcMethodHandler:
    async def call(request_bytes: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            request = request_type.FromString(request_bytes)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request_type.__name__}: {exc}")
        try:
            response = await handler(request)
        except EngineError as exc:
            await context.abort(exc.grpc_code, str(exc))
        return response.SerializeToString(deterministic=True)

    return grpc.unary_unary_rpc_method_handler(call)


def generic_handler(service: InferenceService) -> grpc.GenericRpcHandler:
    s = GrpcInferenceServicer(service)
    return grpc.method_handlers_generic_handler(SERVICE, {
        "ServerLive": _unary(s.server_live, pb.ServerLiveRequest),
        "ServerReady": _unary(s.server_ready, pb.ServerReadyRequest),
        "ModelReady": _unary(s.model_ready, pb.ModelReadyRequest),
        "ServerMetadata": _unary(s.server_metadata, pb.ServerMetadataRequest),
        "ModelMetadata": _unary(s.model_metadata, pb.ModelMetadataRequest),
        "ModelInfer": _unary(s.model_infer, pb.ModelInferRequest),
        "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(s.model_stream_infer),
        "ModelConfig": _unary(s.model_config, pb.ModelConfigRequest),
        "ModelStatistics": _unary(s.model_statistics, pb.ModelStatisticsRequest),
        "RepositoryIndex": _unary(s.repository_index, pb.RepositoryIndexRequest),
        "RepositoryModelLoad": _unary(s.repository_model_load, pb.RepositoryModelLoadRequest),
        "RepositoryModelUnload": _unary(s.repository_model_unload, pb.RepositoryModelUnloadRequest),
    })


def create_server(service: InferenceService, host: str, port: int, max_message_bytes: int) -> grpc.aio.Server:
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ])
    server.add_generic_rpc_handlers((generic_handler(service),))
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind gRPC to {host}:{port}")
    return server
