"""meshcache: mesh-level response cache for ML inference traffic."""
