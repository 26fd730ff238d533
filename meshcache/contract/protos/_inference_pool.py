"""The private protobuf descriptor pool of the `inference.*` modules (scripts/gen_protos.sh)."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
