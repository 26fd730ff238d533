"""The mesh's one error type (its own module so light commands need not import the topology)."""


class MeshError(RuntimeError):
    """The mesh cannot start; the message names the cause (port, binary, component + log tail)."""
