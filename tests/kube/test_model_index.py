"""meshcache/ctl/kube/model_index.py on its failure paths (the happy path, a kube mesh's engine
pods answering, is in test_up_cli.py): a pod that cannot be read is a warning, not a crash, and
only a kube mesh's state is read this way."""

from __future__ import annotations

from meshcache.ctl.kube import model_index


def test_an_unreadable_engine_pod_is_a_warning() -> None:
    endpoints = {"mode": "kube", "engine_netns": {"meshcache-engine-x.ns": "mc-no-such-netns-35"}}
    warnings = model_index.typo_warnings(endpoints, "resnet")
    assert len(warnings) == 1 and warnings[0].startswith(
        "could not read every engine's model index (meshcache-engine-x.ns: "), warnings
    # No model known: no typo claimed.
    assert not any("matches no model" in w for w in warnings)


def test_only_a_kube_mesh_is_read_by_the_cli() -> None:
    netns = {"meshcache-engine-x.ns": "mc-no-such-netns-35"}
    assert model_index.typo_warnings({"mode": "istiod", "engine_netns": netns}, "resnet") == []
    assert model_index.typo_warnings({"mode": "kube"}, "resnet") == []
