"""The Wasm module over OCI with a wrong digest (`meshcache istio render --image-digest` of an image
the registry does not hold, rolled out to the control plane): istio-agent refuses it and the
sidecars keep serving; rolled back, the filter comes back.

What istio-agent does (istio.io/istio pkg/wasm, `MaybeConvertWasmExtensionConfig`): it fetches the
`oci://...@sha256:<digest>` URL from the ECDS resource before Envoy sees it; when that fails (no
image with that digest: MANIFEST_UNKNOWN; or a module whose digest differs from the `sha256`
field) it logs "error in converting the wasm config to local ... applying allow RBAC filter" and
hands Envoy, under the same ECDS name, an allow-all RBAC filter (stat prefix
`wasm-default-allow`) because the config is FAIL_OPEN. No NACK: istiod sees an ACK. The
listeners and routes stay as they are; requests pass uncached."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from meshcache.contract.extensions import AFFINITY_LABEL
from meshcache.ctl.istio import render
from meshcache.ctl.istiod.status import ECDS_TYPE_URL
from meshcache.ctl.kube.mesh import KubeMesh
from tests.helpers.kserve import mlp_json
from tests.helpers.wait import eventually
from tests.kube.mesh.helpers import (
    CACHE_CALLER,
    NS,
    caller_pod,
    ecds_filters,
    engine_calls,
    http_ok,
    ready_engine_pods,
    running,
    service_ip,
)

Obj = dict[str, Any]
WRONG_DIGEST = "0" * 64
REFUSED = "error in converting the wasm config to local"


def _types(mesh: KubeMesh, pods: list[Obj]) -> dict[str, str]:
    """The @type each engine sidecar runs under the ECDS name `meshcache`."""
    return {p["metadata"]["name"]: ecds_filters(running(mesh, p))["meshcache"]["typed_config"]["@type"]
            for p in pods}


def test_a_wrong_digest_is_refused_by_istio_agent_and_the_sidecars_keep_serving(kube_mesh: KubeMesh) -> None:
    assert kube_mesh.istiod is not None
    pods = ready_engine_pods(kube_mesh)
    ip = service_ip(kube_mesh)
    client = caller_pod(kube_mesh, CACHE_CALLER, "meshcache-client", {AFFINITY_LABEL: "true"})
    path, body = "/v2/models/mlp-classifier/infer", json.dumps(mlp_json(seed=3404))

    post = partial(http_ok, client, path, ip, body)

    cached = eventually(post, timeout=30)
    assert post()["headers"]["cache-status"].startswith("meshcache; hit; ttl=")
    assert all(t.endswith("wasm.v3.Wasm") for t in _types(kube_mesh, pods).values())
    logs = {p["metadata"]["name"]: running(kube_mesh, p).procs["istio-proxy"] for p in pods}
    offsets = {name: proc.log_path.stat().st_size for name, proc in logs.items()}

    cfg = kube_mesh.config
    opts = render.RenderOptions(namespace=cfg.namespace, module_path=cfg.module, image_digest=WRONG_DIGEST)
    wrong = render.render(opts)
    try:
        kube_mesh.roll_control_plane(wrong)
        # Each agent tried the pinned URL, refused it and gave Envoy the fail-open stand-in.
        def refused() -> dict[str, str]:
            types = _types(kube_mesh, pods)
            assert all(t.endswith("rbac.v3.RBAC") for t in types.values()), types
            return types

        eventually(refused, timeout=60, interval=0.5)
        for name, proc in logs.items():
            with open(proc.log_path, errors="replace") as f:
                f.seek(offsets[name])
                log = f.read()
            assert REFUSED in log and f"@sha256:{WRONG_DIGEST}" in log and "applying allow RBAC filter" in log, \
                log[-2000:]
        # Not a NACK: istiod has the agent's ACK of the (rewritten) ECDS resource.
        sync = {s["proxy"]: s for s in kube_mesh.istiod.debug("syncz") or []}
        for pod in pods:
            ecds = sync[f"{pod['metadata']['name']}.{NS}"]["resources"][ECDS_TYPE_URL]
            assert ecds["acked"] == ecds["sent"] and not ecds.get("lastError"), ecds
        # The sidecars keep serving (listeners, routes, mTLS untouched): the same answer, from the
        # engine, uncached.
        calls = sum(engine_calls(kube_mesh, "mlp-classifier", pods).values())
        passed = post()
        assert "cache-status" not in passed["headers"] and passed["body"] == cached["body"], passed["headers"]
        assert sum(engine_calls(kube_mesh, "mlp-classifier", pods).values()) == calls + 1
    finally:
        kube_mesh.roll_control_plane(kube_mesh.objects)  # back to the rendered pin

    def restored() -> bool:
        # The engine sidecars' filter and the caller's client role (its routing key: affinity).
        client_role = ecds_filters(client)["meshcache-client"]["typed_config"]["@type"]
        return client_role.endswith("wasm.v3.Wasm") and all(
            t.endswith("wasm.v3.Wasm") for t in _types(kube_mesh, pods).values())

    eventually(restored, timeout=60, interval=0.5)
    # The filter is back, in new VMs: the stand-in replaced the old ones, and their entries went
    # with them, so the first request computes the answer again.
    def filtered() -> Obj:
        result = post()
        assert "cache-status" in result["headers"], result["headers"]  # the client sidecar may lag
        return result

    again = eventually(filtered, timeout=30, interval=0.5)
    assert again["headers"]["cache-status"] == "meshcache; fwd=miss; stored" and again["body"] == cached["body"]
    assert post()["headers"]["cache-status"].startswith("meshcache; hit; ttl=")
