"""The contract layer: what the filter, the control plane, the engine and the tooling agree on.

Defined once here and imported by everything above; imports nothing of the project itself
(tests/test_layering.py checks). `filter_config` (the filter's plugin configuration: fields,
defaults, limits, canonical JSON, demo policies), `headers`, `wasm_filter` (the Envoy Wasm filter
that runs the module), `grpc_hit` (the single-pass gRPC-hit Envoy fragments), `extensions` and
`oci` (what istiod gets, EnvoyFilter or TrafficExtension, and the module's OCI image), `paths`,
and the generated `protos`.
"""
