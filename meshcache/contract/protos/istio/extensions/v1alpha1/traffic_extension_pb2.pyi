from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import wrappers_pb2 as _wrappers_pb2
from meshcache.contract.protos.istio.extensions.v1alpha1 import wasm_pb2 as _wasm_pb2
from meshcache.contract.protos.istio.type.v1beta1 import selector_pb2 as _selector_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrafficExtension(_message.Message):
    __slots__ = ("selector", "phase", "priority", "match", "wasm")
    class ExecutionPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNSPECIFIED: _ClassVar[TrafficExtension.ExecutionPhase]
        AUTHN: _ClassVar[TrafficExtension.ExecutionPhase]
        AUTHZ: _ClassVar[TrafficExtension.ExecutionPhase]
        STATS: _ClassVar[TrafficExtension.ExecutionPhase]
    UNSPECIFIED: TrafficExtension.ExecutionPhase
    AUTHN: TrafficExtension.ExecutionPhase
    AUTHZ: TrafficExtension.ExecutionPhase
    STATS: TrafficExtension.ExecutionPhase
    SELECTOR_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MATCH_FIELD_NUMBER: _ClassVar[int]
    WASM_FIELD_NUMBER: _ClassVar[int]
    selector: _selector_pb2.WorkloadSelector
    phase: TrafficExtension.ExecutionPhase
    priority: _wrappers_pb2.Int32Value
    match: _containers.RepeatedCompositeFieldContainer[TrafficSelector]
    wasm: WasmConfig
    def __init__(self, selector: _Optional[_Union[_selector_pb2.WorkloadSelector, _Mapping]] = ..., phase: _Optional[_Union[TrafficExtension.ExecutionPhase, str]] = ..., priority: _Optional[_Union[_wrappers_pb2.Int32Value, _Mapping]] = ..., match: _Optional[_Iterable[_Union[TrafficSelector, _Mapping]]] = ..., wasm: _Optional[_Union[WasmConfig, _Mapping]] = ...) -> None: ...

class WasmConfig(_message.Message):
    __slots__ = ("url", "sha256", "image_pull_policy", "image_pull_secret", "verification_key", "plugin_config", "plugin_name", "fail_strategy", "vm_config", "type")
    URL_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    IMAGE_PULL_POLICY_FIELD_NUMBER: _ClassVar[int]
    IMAGE_PULL_SECRET_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_KEY_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_NAME_FIELD_NUMBER: _ClassVar[int]
    FAIL_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    VM_CONFIG_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    url: str
    sha256: str
    image_pull_policy: _wasm_pb2.PullPolicy
    image_pull_secret: str
    verification_key: str
    plugin_config: _struct_pb2.Struct
    plugin_name: str
    fail_strategy: _wasm_pb2.FailStrategy
    vm_config: _wasm_pb2.VmConfig
    type: _wasm_pb2.PluginType
    def __init__(self, url: _Optional[str] = ..., sha256: _Optional[str] = ..., image_pull_policy: _Optional[_Union[_wasm_pb2.PullPolicy, str]] = ..., image_pull_secret: _Optional[str] = ..., verification_key: _Optional[str] = ..., plugin_config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., plugin_name: _Optional[str] = ..., fail_strategy: _Optional[_Union[_wasm_pb2.FailStrategy, str]] = ..., vm_config: _Optional[_Union[_wasm_pb2.VmConfig, _Mapping]] = ..., type: _Optional[_Union[_wasm_pb2.PluginType, str]] = ...) -> None: ...

class TrafficSelector(_message.Message):
    __slots__ = ("mode", "ports")
    MODE_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    mode: _selector_pb2.WorkloadMode
    ports: _containers.RepeatedCompositeFieldContainer[_selector_pb2.PortSelector]
    def __init__(self, mode: _Optional[_Union[_selector_pb2.WorkloadMode, str]] = ..., ports: _Optional[_Iterable[_Union[_selector_pb2.PortSelector, _Mapping]]] = ...) -> None: ...
