"""A real istiod (pilot-discovery built from the pinned istio.io/istio module) without Kubernetes:
its launcher, the translation of the rendered istio/ objects into what it reads from `fs://`, and
the sidecars it configures (istio-agent's bootstrap and SDS role). See docs/istio.md, "Running
against a real istiod"."""
