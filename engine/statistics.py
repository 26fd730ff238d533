"""Triton's per model version statistics (the statistics extension): counts and cumulative
durations in nanoseconds, kept as plain integers on the event loop thread (no locks, a few
additions per request)."""

from __future__ import annotations

import time

from meshcache.contract.protos import grpc_predict_v2_pb2 as pb


class Duration:
    __slots__ = ("count", "ns")

    def __init__(self) -> None:
        self.count = 0
        self.ns = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def fill(self, out: pb.StatisticDuration) -> None:
        out.count, out.ns = self.count, self.ns


class BatchStats:
    __slots__ = ("compute_input", "compute_infer", "compute_output")

    def __init__(self) -> None:
        self.compute_input, self.compute_infer, self.compute_output = Duration(), Duration(), Duration()


class ModelStats:
    """As Triton reports them: success/fail per request from arrival to answer; queue per request;
    compute_* per request, each request charged its whole batch's time; batch_stats per run."""

    def __init__(self) -> None:
        self.last_inference_ms = 0
        self.inference_count = 0
        self.execution_count = 0
        self.success, self.fail, self.queue = Duration(), Duration(), Duration()
        self.compute_input, self.compute_infer, self.compute_output = Duration(), Duration(), Duration()
        self.batches: dict[int, BatchStats] = {}

    def request_done(self, ok: bool, ns: int, rows: int) -> None:
        if ok:
            self.success.add(ns)
            self.inference_count += rows
            self.last_inference_ms = time.time_ns() // 1_000_000
        else:
            self.fail.add(ns)

    def batch_done(self, rows: int, requests: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        self.execution_count += 1
        self.compute_input.add(input_ns * requests, requests)
        self.compute_infer.add(infer_ns * requests, requests)
        self.compute_output.add(output_ns * requests, requests)
        batch = self.batches.get(rows)
        if batch is None:
            batch = self.batches[rows] = BatchStats()
        batch.compute_input.add(input_ns)
        batch.compute_infer.add(infer_ns)
        batch.compute_output.add(output_ns)

    def to_proto(self, name: str, version: str) -> pb.ModelStatistics:
        out = pb.ModelStatistics(name=name, version=version, last_inference=self.last_inference_ms,
                                 inference_count=self.inference_count, execution_count=self.execution_count)
        s = out.inference_stats
        for field in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
            getattr(self, field).fill(getattr(s, field))
        s.cache_hit.SetInParent()
        s.cache_miss.SetInParent()
        for rows in sorted(self.batches):
            batch = self.batches[rows]
            b = out.batch_stats.add(batch_size=rows)
            batch.compute_input.fill(b.compute_input)
            batch.compute_infer.fill(b.compute_infer)
            batch.compute_output.fill(b.compute_output)
        return out
