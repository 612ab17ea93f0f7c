"""The pieces of relaying one request: parsing what arrives, carrying trace context to workers,
watching the prefill call beside the decode stream, and deciding what a failure means."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import grpc
from opentelemetry import context as otel_context
from tandem.v1 import api_pb2

from cluster.request import SamplingParams
from cluster.slo import RequestTiming, Targets
from cluster.telemetry import inject
from router.placement import Choice


@dataclass(frozen=True)
class Malformed:
    """A request whose bytes did not parse."""

    error: str


def parse(message_type):  # type: ignore[no-untyped-def]
    def parse(data: bytes):  # type: ignore[no-untyped-def]
        try:
            return message_type.FromString(data)
        except Exception as e:  # protobuf's DecodeError, invalid UTF-8 in a string field, ...
            return Malformed(str(e) or type(e).__name__)

    return parse


def trace_metadata(trace_context: otel_context.Context) -> list[tuple[str, str]]:
    token = otel_context.attach(trace_context)
    try:
        return inject()
    finally:
        otel_context.detach(token)


def slo_report(timing: RequestTiming, targets: Targets) -> api_pb2.SloReport:
    return api_pb2.SloReport(
        met=targets.met(timing.ttft, timing.tpot),
        ttft_seconds=timing.ttft,
        tpot_seconds=timing.tpot or 0.0,
        ttft_target_seconds=targets.ttft_s,
        tpot_target_seconds=targets.tpot_s,
    )


# A worker that died or vanished: the request can continue elsewhere.
MIGRATABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
               grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED}  # fmt: skip


class Broken(Exception):
    """An attempt failed at a worker (`where` is "decode" or "prefill")."""

    def __init__(self, code: grpc.StatusCode, details: str, where: str, worker: str) -> None:
        super().__init__(details)
        self.code, self.details, self.where, self.worker = code, details, where, worker

    @property
    def migratable(self) -> bool:
        return self.code in MIGRATABLE


def rest_of(params: SamplingParams, streamed: int) -> SamplingParams:
    """The sampling parameters for the rest of a request that has already streamed `streamed` tokens."""
    if not streamed:
        return params
    return dataclasses.replace(
        params, max_tokens=params.max_tokens - streamed, min_tokens=max(0, params.min_tokens - streamed)
    )


def watch_prefill(prefill_call, decode_call, result: dict[str, object]) -> None:  # type: ignore[no-untyped-def]
    """Consumes the prefill call; if it fails, the request fails with its error."""
    try:
        for msg in prefill_call:
            result["cached"] = msg.num_cached_tokens
    except grpc.RpcError as e:
        if e.code() is grpc.StatusCode.CANCELLED and result.get("cancelled"):
            return  # the router cancelled it itself
        result["error"] = e
        decode_call.cancel()


def describe(choice: Choice) -> str:
    return choice.reason if choice.prefill is None else f"{choice.reason}:{choice.prefill}"
