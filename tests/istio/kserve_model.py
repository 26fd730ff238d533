"""A KServe Python runtime (KServe's own ModelServer, in `.venv-kserve`) serving one echo model;
run by test_server_metrics.py. Imports nothing from meshcache (kserve pins protobuf < 7).

    python kserve_model.py HTTP_PORT MODEL_NAME
"""

from __future__ import annotations

import sys
from typing import Any

from kserve import Model, ModelServer


class Echo(Model):
    """Answers a v1 predict with its instances: enough for the runtime's own request metrics."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.ready = True

    async def predict(self, payload: Any, headers: Any = None) -> dict[str, Any]:
        return {"predictions": payload.get("instances", [])}


if __name__ == "__main__":
    ModelServer(http_port=int(sys.argv[1]), enable_grpc=False, workers=1).start([Echo(sys.argv[2])])
