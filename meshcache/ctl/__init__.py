"""Operator tooling on top of everything (as Istio keeps istioctl apart from pilot): the `meshcache`
CLI, the local mesh, Istio render/validate, Envoy bootstrap rendering, PKI and process launching.
Nothing below (contract, control plane, engine) imports it."""
