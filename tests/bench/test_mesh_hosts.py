"""bench.mesh_hosts' pure parts: rounds merged per row, native over Wasm for hits."""

from __future__ import annotations

from bench.mesh_hosts import Measured, host_ratios, merge_rounds, render


def _m(host: str, case: str, client: str, c: int, rps: float, p50: float, cpu: float,
       statuses: dict[str, int] | None = None) -> Measured:
    return Measured(host, case, client, c, rps, p50, p50 * 3, 0, cpu, statuses or {}, None)


def test_rounds_merge_into_one_row_per_host_case_client_and_concurrency() -> None:
    rows = [_m("wasm", "hit", "grpc.aio", 1, 1000, 1.0, 200, {"hit": 10}),
            _m("native", "hit", "grpc.aio", 1, 1500, 0.6, 100, {"hit": 15}),
            _m("native", "hit", "grpc.aio", 1, 1700, 0.8, 120, {"hit": 17, "stored": 1}),
            _m("wasm", "hit", "grpc.aio", 1, 1200, 2.0, 220, {"hit": 12})]
    merged = {r.host: r for r in merge_rounds(rows)}
    assert set(merged) == {"wasm", "native"}
    native = merged["native"]
    assert native.rps == 1600 and native.rounds_rps == [1500, 1700]
    assert native.p50_ms == 0.7 and native.cpu_us == 110
    assert native.statuses == {"hit": 32, "stored": 1}


def test_hit_ratios_are_native_over_wasm_at_the_same_client_and_concurrency() -> None:
    rows = [_m("wasm", "hit", "h2load", 8, 2000, 2.0, 200), _m("native", "hit", "h2load", 8, 3000, 1.0, 100),
            _m("wasm", "hit", "h2load", 1, 900, 0.5, 300),  # no native row at this level: no ratio
            _m("wasm", "miss", "grpc.aio", 8, 100, 20.0, 500), _m("native", "miss", "grpc.aio", 8, 200, 10.0, 400)]
    assert host_ratios(rows) == [["h2load", "8", "0.50", "0.50", "1.50", "0.50"]]
    text = render(rows, 5, 1, 2, (3.0, 4.0))
    assert "| native (Envoy 1.39) | hit | h2load | 8 | 3000 | 1.00 | 3.00 | 100 | 0 |  |" in text
    assert "load average 3.00 when the run started, 4.00 when it ended" in text
