"""The local mesh: `meshcache up|down|status|demo|policy` (see topology.py for the shape)."""
