"""The KServe v2 gRPC transport (inference.GRPCInferenceService) on grpc.aio.

Requests arrive as raw bytes and are parsed here, so a malformed protobuf is answered with
INVALID_ARGUMENT instead of grpcio's generic deserialization error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from engine import tensors
from engine.errors import EngineError, InvalidInput
from engine.models import LoadedModel
from engine.service import EXTENSIONS, SERVER_NAME, SERVER_VERSION, InferenceService, parse_priority
from meshcache.protos import grpc_predict_v2_pb2 as pb

SERVICE = "inference.GRPCInferenceService"


def _param_value(param: pb.InferParameter) -> object:
    choice = param.WhichOneof("parameter_choice")
    return None if choice is None else getattr(param, choice)


class GrpcInferenceServicer:
    def __init__(self, service: InferenceService) -> None:
        self.service = service

    async def server_live(self, request: pb.ServerLiveRequest) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request: pb.ServerReadyRequest) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.service.ready)

    async def model_ready(self, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
        self.service.repository.get(request.name, request.version)
        return pb.ModelReadyResponse(ready=self.service.ready)

    async def server_metadata(self, request: pb.ServerMetadataRequest) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=EXTENSIONS)

    async def model_metadata(self, request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:
        model = self.service.repository.get(request.name, request.version)
        entry = self.service.repository.entry(request.name)
        cfg = model.config
        meta = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=cfg.name,
            versions=[model.version] if request.version else entry.sorted_versions(),
            platform=cfg.platform,
            inputs=[meta(name=s.name, datatype=s.datatype, shape=cfg.full_shape(s)) for s in cfg.inputs],
            outputs=[meta(name=s.name, datatype=s.datatype, shape=cfg.full_shape(s)) for s in cfg.outputs],
        )

    async def model_infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        async with self.service.request(request.model_name, "grpc"):
            model = self.service.repository.get(request.model_name, request.model_version)
            priority = parse_priority(_param_value(request.parameters["priority"])
                                      if "priority" in request.parameters else None)
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
            outputs = await self.service.infer(model, inputs, requested, priority)
            return self._response(request, model, outputs, as_raw=bool(raw))

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
