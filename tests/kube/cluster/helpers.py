"""What the cluster tests share: a kubeconfig that acts as a ServiceAccount (its token)."""

from __future__ import annotations

from pathlib import Path

import yaml

from meshcache.ctl.kube.cluster import LocalCluster


def service_account_kubeconfig(cluster: LocalCluster, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig with a token of `namespace/account` (`kubectl create token`, 2 h): the API
    server authorizes its calls as that pod identity would be."""
    token = cluster.kubectl("create", "token", account, "-n", namespace, "--duration=2h").stdout.strip()
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "local", "cluster": {"server": cluster.server,
                                                   "certificate-authority": str(cluster.pki.ca.cert)}}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "local", "user": "sa"}}]}))
    path.chmod(0o600)
    return path
