"""A minimal local volume provisioner for the test node: every pending PersistentVolumeClaim
without a storage class gets a hostPath PersistentVolume of the size it asks for, on a directory
of the node, pre-bound to it (claimRef); kube-controller-manager's PV binder completes the bind
and the scheduler then places the claim's pod.

Not done: storage classes, WaitForFirstConsumer, resizing, reclaiming (the PV is Retain; the
node's directories go when the node stops), access modes beyond recording them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

Obj = dict[str, Any]


def pv_for(claim: Obj, directory: Path) -> Obj:
    meta, spec = claim["metadata"], claim["spec"]
    name = f"pvc-{meta['uid']}"
    return {"apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": name, "labels": {"meshcache.io/provisioner": "test-node"}},
            "spec": {"capacity": {"storage": spec.get("resources", {}).get("requests", {}).get("storage", "1Gi")},
                     "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                     "volumeMode": spec.get("volumeMode", "Filesystem"),
                     "hostPath": {"path": str(directory / name), "type": "DirectoryOrCreate"},
                     "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": meta["namespace"],
                                  "name": meta["name"], "uid": meta["uid"]}}}


def provision(api: httpx.Client, directory: Path) -> list[str]:
    """PersistentVolumes for the claims that need one; returns their names."""
    claims = api.get("/api/v1/persistentvolumeclaims").raise_for_status().json()["items"]
    made = []
    for claim in claims:
        spec = claim["spec"]
        if spec.get("volumeName") or spec.get("storageClassName") or claim.get("status", {}).get("phase") == "Bound":
            continue
        r = api.post("/api/v1/persistentvolumes", json=pv_for(claim, directory))
        if r.status_code != 409:  # 409: made on an earlier pass, the binder not done yet
            r.raise_for_status()
            made.append(r.json()["metadata"]["name"])
    return made
