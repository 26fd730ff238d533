"""Prometheus metrics of one control-plane instance (own registry: several can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.snapshot_version = Gauge("meshcache_cp_snapshot_version", "Current snapshot version", registry=r)
        self.writes = Counter(
            "meshcache_cp_writes", "Policy writes by outcome", ["outcome"], registry=r
        )
        self.redis_up = Gauge("meshcache_cp_redis_up", "1 when the last Redis operation worked", registry=r)
        self.degraded = Gauge("meshcache_cp_degraded", "1 while the policy store (Redis) is unreachable and this "
                              "replica serves its last good snapshot from memory or the state file (or none)",
                              registry=r)
        self.snapshot_source = Gauge("meshcache_cp_snapshot_source", "1 for where the served snapshot comes from: "
                                     "redis, memory, disk (state file) or none (nothing served)", ["source"],
                                     registry=r)
        self.state_writes = Counter("meshcache_cp_state_file_writes", "Snapshots saved to the state file, by outcome",
                                    ["outcome"], registry=r)
        self.streams = Gauge("meshcache_cp_xds_streams", "Open xDS streams", ["transport"], registry=r)
        self.pushes = Counter("meshcache_cp_xds_pushes", "xDS responses sent", ["type_url"], registry=r)
        self.acks = Counter("meshcache_cp_xds_acks", "xDS ACKs received", registry=r)
        self.nacks = Counter("meshcache_cp_xds_nacks", "xDS NACKs received", registry=r)
        self.ack_latency = Histogram(
            "meshcache_cp_push_to_ack_seconds", "From a snapshot reaching this replica to the ACK",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=r,
        )
        self.semantic_purges = Counter(
            "meshcache_cp_semantic_purges", "Purges sent to the semantic index service by outcome: ok, error "
            "(logged; the entries expire with their TTL), dropped (too many in flight)", ["outcome"], registry=r)

        # delivery kube (kube_writer.py)
        self.kube_applied_version = Gauge(
            "meshcache_cp_kube_applied_version", "Snapshot version whose Istio objects this replica last wrote "
            "to the Kubernetes API server (0: none yet)", registry=r)
        self.kube_passes = Counter(
            "meshcache_cp_kube_passes", "Reconcile passes by outcome: written (the API server holds this replica's "
            "snapshot), no_snapshot, behind and no_owner (the writer's Role is gone; nothing written or deleted), "
            "error", ["outcome"], registry=r)
        self.kube_writes = Counter("meshcache_cp_kube_writes", "Istio objects created, applied or deleted",
                                   ["op"], registry=r)
        self.kube_errors = Counter("meshcache_cp_kube_errors",
                                   "Failed reconcile passes by HTTP status (0: unreachable) or error type",
                                   ["status"], registry=r)
        self.kube_conflicts = Gauge(
            "meshcache_cp_kube_conflicts", "Objects the snapshot names that exist but were not created by the "
            "control plane (left alone)", registry=r)
        self.kube_apply_latency = Histogram(
            "meshcache_cp_kube_apply_seconds", "From a snapshot reaching this replica to its objects written",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
