"""meshcache control plane: policy API, Redis-backed snapshots, and xDS (ECDS/ADS) push to Envoy."""
