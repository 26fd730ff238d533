"""`meshcache up` with the LLM models (`llm: true`) runs the semantic index service and wires it
(issue 38): the service embeds with the engine, the server sidecar has a cluster for it, the
control plane names that cluster in the filter config it serves, the LLM policies turn the layer
on at the shipped threshold, a purge reaches the service, and `meshcache down` stops it."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import httpx

from meshcache.ctl.envoy_config import SEMANTIC_CLUSTER
from meshcache.ctl.mesh import state
from meshcache.ctl.mesh.config import Ports
from meshcache.semantic import DEFAULT_THRESHOLD
from tests.helpers.wait import eventually
from tests.status.helpers import meshcache


def test_up_with_llm_runs_and_wires_the_semantic_service(tmp_path: Path) -> None:
    state_dir, ports = tmp_path / "state", Ports.free()
    config = tmp_path / "mesh.json"
    config.write_text(json.dumps({"ports": asdict(ports), "llm": True,
                                  "policies": {"llama3-": {"ttl_s": 600, "semantic": {}}}}))
    try:
        up = meshcache("up", "--detach", "--config", str(config), "--state-dir", str(state_dir), timeout=240)
        assert up.returncode == 0, up.stdout + up.stderr
        current = state.read_state(state_dir)
        assert current is not None
        endpoints = current["endpoints"]
        assert endpoints["semantic"] == f"http://127.0.0.1:{ports.semantic}"
        assert "semantic" in {c["name"] for c in current["children"]}
        semantic = httpx.Client(base_url=endpoints["semantic"], timeout=10)
        assert semantic.get("/healthz").status_code == 200
        # The filter config names the sidecar's cluster and the service's authority.
        token = Path(endpoints["token_file"]).read_text().strip()
        cp = httpx.Client(base_url=endpoints["control_plane_api"], headers={"Authorization": f"Bearer {token}"},
                          timeout=10)
        served = json.loads(cp.get("/v1/snapshot").json()["plugin_config"])
        assert served["semantic_service"] == {"cluster": SEMANTIC_CLUSTER, "authority": f"127.0.0.1:{ports.semantic}",
                                              "timeout_ms": 200}
        assert served["policies"][0]["semantic"] == {"threshold": DEFAULT_THRESHOLD, "shadow": False}
        # The server sidecar has that cluster, its one host the service, healthy (STATIC, reachable).
        clusters = httpx.get(f"http://127.0.0.1:{ports.server_admin}/clusters", params={"format": "json"},
                             timeout=10).json()["cluster_statuses"]
        mine = next(c for c in clusters if c["name"] == SEMANTIC_CLUSTER)
        address = mine["host_statuses"][0]["address"]["socket_address"]
        assert (address["address"], address["port_value"]) == ("127.0.0.1", ports.semantic)
        # The service embeds with the mesh's engine: a stored prompt is found again, by similarity.
        scope = "ab" * 32
        stored = semantic.post("/v1/semantic/store", json={"policy": "llama3-", "scope": scope, "ttl_s": 60,
                                                           "text": "How do I reset my password?", "key": "k1"})
        assert stored.status_code == 200, stored.text
        found = semantic.post("/v1/semantic/lookup", json={"scope": scope, "text": "how do i reset my password?",
                                                           "threshold": DEFAULT_THRESHOLD}).json()
        assert found["hit"] and found["key"] == "k1", found
        # A purge of the policy reaches the service (in the background) and empties its entries.
        assert cp.post("/v1/purge", json={"model_prefix": "llama3-"}).status_code == 200
        eventually(lambda: semantic.get("/v1/semantic/stats").json()["entries"] == 0, timeout=10)
        semantic.close()
        cp.close()
        down = meshcache("down", "--state-dir", str(state_dir), timeout=60)
        assert down.returncode == 0, down.stdout + down.stderr
        with httpx.Client(timeout=2) as http:
            try:
                http.get(f"http://127.0.0.1:{ports.semantic}/healthz")
                raise AssertionError("the semantic service still answers after `meshcache down`")
            except httpx.TransportError:
                pass
    finally:
        state.stop_mesh(state_dir, timeout=30)
