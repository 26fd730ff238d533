"""A real Kubernetes control plane on 127.0.0.1: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler built from their Go modules by scripts/build_kube.sh (`make setup`), with their own
PKI and a kubeconfig (cluster.LocalCluster)."""
