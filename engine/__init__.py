"""meshcache engine: KServe v2 inference server on onnxruntime with dynamic batching."""
