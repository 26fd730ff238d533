#!/usr/bin/env bash
# Regenerates meshcache/contract/protos/grpc_predict_v2_pb2{,_grpc}.py and model_config_pb2.py from proto/
# with the venv's grpcio-tools. The outputs are committed; rerun after editing the .proto.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
OUT="$ROOT/meshcache/contract/protos"
mkdir -p "$OUT"
"$PY" -m grpc_tools.protoc -I "$ROOT/proto" --python_out="$OUT" --pyi_out="$OUT" \
  --grpc_python_out="$OUT" "$ROOT/proto/grpc_predict_v2.proto" "$ROOT/proto/model_config.proto"
rm -f "$OUT/model_config_pb2_grpc.py"  # no services in it
# protoc emits `import x_pb2`, which only works with the output dir on sys.path.
sed -i -E 's/^import (grpc_predict_v2_pb2|model_config_pb2) as /from . import \1 as /' \
  "$OUT/grpc_predict_v2_pb2_grpc.py" "$OUT/grpc_predict_v2_pb2.py" "$OUT/grpc_predict_v2_pb2.pyi"
# tritonclient (and other KServe v2 / Triton stubs) register the same `inference.*` names in
# protobuf's default pool, and a second registration fails at import. A private pool, shared by
# the two files (one imports the other), lets both live in one process; the wire format is unchanged.
cat > "$OUT/_inference_pool.py" <<'PY'
"""The private protobuf descriptor pool of the `inference.*` modules (scripts/gen_protos.sh)."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
PY
for f in grpc_predict_v2_pb2.py model_config_pb2.py; do
  sed -i 's/^DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(/from ._inference_pool import POOL as _POOL\nDESCRIPTOR = _POOL.AddSerializedFile(/' "$OUT/$f"
  grep -q '^DESCRIPTOR = _POOL' "$OUT/$f" || { echo "private-pool rewrite failed in $f" >&2; exit 1; }
done
grep -q '^from \. import grpc_predict_v2_pb2' "$OUT/grpc_predict_v2_pb2_grpc.py" || { echo "import rewrite failed" >&2; exit 1; }
grep -q '^from \. import model_config_pb2' "$OUT/grpc_predict_v2_pb2.py" || { echo "import rewrite failed" >&2; exit 1; }
[ -f "$OUT/__init__.py" ] || echo '"""Generated protobuf modules (scripts/gen_protos.sh)."""' > "$OUT/__init__.py"

# Istio subset (proto/istio/..., written for meshcache with Istio's field numbers) for MCP-over-xDS.
# No package collides with `istio.*` in protobuf's default pool, so these stay in it (Any.Unpack
# and json_format work as usual). protoc emits absolute `from istio.x import y_pb2`: make them
# package-relative to meshcache.contract.protos.
ISTIO_PROTOS=(istio/type/v1beta1/selector.proto istio/mcp/v1alpha1/metadata.proto
  istio/mcp/v1alpha1/resource.proto istio/extensions/v1alpha1/wasm.proto
  istio/extensions/v1alpha1/traffic_extension.proto istio/networking/v1alpha3/envoy_filter.proto)
"$PY" -m grpc_tools.protoc -I "$ROOT/proto" --python_out="$OUT" --pyi_out="$OUT" \
  "${ISTIO_PROTOS[@]/#/$ROOT/proto/}"
for f in "$OUT"/istio/*/*/*_pb2.py "$OUT"/istio/*/*/*_pb2.pyi; do
  sed -i 's/^from istio\./from meshcache.contract.protos.istio./' "$f"
done
! grep -rq '^from istio\.' "$OUT/istio" || { echo "istio import rewrite failed" >&2; exit 1; }
for d in "$OUT/istio" "$OUT"/istio/* "$OUT"/istio/*/*; do
  case "$d" in */__pycache__) continue ;; esac
  [ ! -d "$d" ] || [ -f "$d/__init__.py" ] || : > "$d/__init__.py"
done
echo "generated into $OUT"
