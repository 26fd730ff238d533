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
echo "generated into $OUT"
