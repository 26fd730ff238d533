"""bench.filter's tables: each host's ratios are to plain proxying by its own Envoy, issue 37's targets."""

from __future__ import annotations

from bench.filter import NO_FILTER, NO_FILTER_1_39, Row, baseline_mode, render, target
from bench.loadgen import LoadResult


def _row(protocol: str, mode: str, rps: float, cpu_us: float = 50.0) -> Row:
    return Row(protocol, "1 KiB", mode, LoadResult(rps, 1.0, 2.0, 1.0, 0, int(rps)), "-", cpu_us=cpu_us)


def _summary(text: str) -> dict[tuple[str, str], list[str]]:
    """The ratio table's rows by (protocol, host)."""
    table = text.split("Ratios (")[1]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("| ")]
    return {(c[0], c[2]): c for c in cells[1:]}


def test_envoy_1_39_rows_are_measured_against_plain_envoy_1_39() -> None:
    assert baseline_mode("native-1.39, hits (single pass)") == NO_FILTER_1_39
    assert baseline_mode("native-1.39, misses") == NO_FILTER_1_39
    assert baseline_mode("native, hits") == NO_FILTER
    assert baseline_mode("Wasm without held headers, hits (single pass)") == NO_FILTER
    assert baseline_mode(NO_FILTER_1_39) == NO_FILTER  # Envoy 1.39's plain speed over 1.40's


def test_summary_has_the_1_39_host_with_its_own_baseline() -> None:
    rows = [_row("HTTP/1.1", NO_FILTER, 10_000, 60), _row("HTTP/1.1", NO_FILTER_1_39, 8_000, 64),
            _row("HTTP/1.1", "native, misses", 7_000), _row("HTTP/1.1", "native, hits", 20_000, 30),
            _row("HTTP/1.1", "native-1.39, misses", 4_000), _row("HTTP/1.1", "native-1.39, hits", 16_000, 31),
            _row("HTTP/1.1", "Envoy cache filter, GET hits", 25_000)]
    text = render(rows, 3, (1.5, 2.5))
    main_table = {c[2]: c for c in ([p.strip() for p in line.strip("|").split("|")]
                                    for line in text.split("Ratios (")[0].splitlines() if line.startswith("| "))}
    assert main_table["native-1.39, hits"][7] == "2.00x"  # 16k / plain 1.39's 8k, not 1.40's 10k
    assert main_table[NO_FILTER_1_39][7] == "0.80x"
    summary = _summary(text)
    old, new = summary[("HTTP/1.1", "native-1.39")], summary[("HTTP/1.1", "native")]
    assert old[3:7] == ["2.00x", "≥ 2.0x", "0.50x", "-"]
    assert old[11] == "31 / 50 / 64"  # CPU of hit / miss / its own Envoy's plain
    assert new[3] == "2.00x" and new[5] == "0.70x"
    assert old[8:10] == ["0.64x", "≥ 1.0x"]  # hits over Envoy's cache filter's GET hits
    assert "load average 1.50 when the run started, 2.50 when it ended" in text
    assert "HTTP/1.1 1 KiB 0.80x (64 / 60)" in text


def test_issue_37_targets() -> None:
    for host in ("native", "native-1.39"):
        for protocol in ("HTTP/1.1", "gRPC"):
            assert target(host, "hits", protocol, "1 KiB") == target(host, "hits", protocol, "64 KiB") == "≥ 2.0x"
        assert target(host, "hits", "HTTP/1.1", "1 MiB") == "-"
        assert target(host, "Envoy cache filter", "HTTP/1.1", "64 KiB") == "≥ 1.0x"
    assert target("Wasm", "hits", "HTTP/1.1", "1 KiB") == "≥ 1.3x"
    assert target("Wasm", "hits", "gRPC", "1 KiB") == target("Wasm", "hits", "gRPC", "1 MiB") == "≥ 1.0x"
    assert target("Wasm without held headers", "hits", "gRPC", "64 KiB") == "≥ 1.0x"
    assert target("Wasm", "hits", "gRPC", "8 MiB") == "-"
    assert target("Wasm", "misses", "gRPC", "1 KiB") == "≥ 0.55x"
    assert target("Wasm", "misses", "HTTP/1.1", "64 KiB") == "≥ 0.35x"
