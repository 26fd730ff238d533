"""Istio integration: manifests (istio/), offline validation, rendering and the OCI image."""
