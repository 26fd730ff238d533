#!/usr/bin/env bash
# Regenerates meshcache/protos/grpc_predict_v2_pb2{,_grpc}.py from proto/grpc_predict_v2.proto
# with the venv's grpcio-tools. The outputs are committed; rerun after editing the .proto.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
OUT="$ROOT/meshcache/protos"
mkdir -p "$OUT"
"$PY" -m grpc_tools.protoc -I "$ROOT/proto" --python_out="$OUT" --pyi_out="$OUT" \
  --grpc_python_out="$OUT" "$ROOT/proto/grpc_predict_v2.proto"
# protoc emits `import grpc_predict_v2_pb2`, which only works with the output dir on sys.path.
sed -i 's/^import grpc_predict_v2_pb2 as /from . import grpc_predict_v2_pb2 as /' \
  "$OUT/grpc_predict_v2_pb2_grpc.py"
# tritonclient (and other KServe v2 stubs) register the same `inference.*` names in protobuf's
# default pool, and a second registration fails at import. A private pool lets both live in one
# process; the wire format is unchanged.
sed -i 's/^DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(/_POOL = _descriptor_pool.DescriptorPool()\nDESCRIPTOR = _POOL.AddSerializedFile(/' \
  "$OUT/grpc_predict_v2_pb2.py"
grep -q '^DESCRIPTOR = _POOL' "$OUT/grpc_predict_v2_pb2.py" || { echo "private-pool rewrite failed" >&2; exit 1; }
grep -q '^from \. import grpc_predict_v2_pb2' "$OUT/grpc_predict_v2_pb2_grpc.py" || { echo "import rewrite failed" >&2; exit 1; }
[ -f "$OUT/__init__.py" ] || echo '"""Generated protobuf modules (scripts/gen_protos.sh)."""' > "$OUT/__init__.py"

# Istio subset (proto/istio/..., written for meshcache with Istio's field numbers) for MCP-over-xDS.
# No package collides with `istio.*` in protobuf's default pool, so these stay in it (Any.Unpack
# and json_format work as usual). protoc emits absolute `from istio.x import y_pb2`: make them
# package-relative to meshcache.protos.
ISTIO_PROTOS=(istio/type/v1beta1/selector.proto istio/mcp/v1alpha1/metadata.proto
  istio/mcp/v1alpha1/resource.proto istio/extensions/v1alpha1/wasm.proto)
"$PY" -m grpc_tools.protoc -I "$ROOT/proto" --python_out="$OUT" --pyi_out="$OUT" \
  "${ISTIO_PROTOS[@]/#/$ROOT/proto/}"
for f in "$OUT"/istio/*/*/*_pb2.py "$OUT"/istio/*/*/*_pb2.pyi; do
  sed -i 's/^from istio\./from meshcache.protos.istio./' "$f"
done
! grep -rq '^from istio\.' "$OUT/istio" || { echo "istio import rewrite failed" >&2; exit 1; }
for d in "$OUT/istio" "$OUT"/istio/* "$OUT"/istio/*/*; do
  [ -f "$d/__init__.py" ] || : > "$d/__init__.py"
done
echo "generated into $OUT"
