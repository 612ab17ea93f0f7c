"""The decode worker as a gRPC server: `tandem.v1.Worker`, `tandem.v1.KVTransfer` and health, on the
shell both workers share (`cluster.worker_shell`: the server's lifecycle, Abort, GetLoad, Watch, Drain).

Lifecycle of a request here:

    Submit(remote_prefill=False)   the prompt is queued on the engine (prefilled here, in chunks),
                                   with the output it already has when it moved here
    Submit(remote_prefill=True)    the call waits for the prompt's KV transfer (`KVIntake`) to be admitted
    engine loop thread             steps the engine while it has work; each output goes to its
                                   request's stream (or waits for a Submit that has not arrived yet)
    the stream ends                on finish; a cancelled or expired call aborts the request and
                                   frees its blocks at once
    Steps                          a router's one stream for all its requests here: its submits and
                                   cancels go up, one frame per step comes down
                                   (`decode_worker.steps.Link`); a request there lives as a Submit's
                                   does, and the stream's end aborts every one still on it
    Watch                          each router's stream of this worker's load (`watch_loads`)

Submit, Steps and Watch run on the front's event loop (`grpc.aio`): no thread per stream. The frame
reader (the engine loop thread) hands each step's outputs over to them; what waits on the engine (an
abort, a Submit's start, a KV push) runs on the server's threads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from tandem.v1 import worker_pb2

from cluster.config import AuthConfig, ClusterConfig
from cluster.engine.adapters import runtime_reader
from cluster.engine.request import UnknownAdapter
from cluster.grpc_server import Refused, adapters_message, admit_submit, check_submit, refusal_code
from cluster.kv.collective import CollectiveGroups
from cluster.kv.grpc_transport import TCP_READ_OPTIONS, KVTransferService, handlers
from cluster.telemetry import Telemetry, extract, loaded_attributes
from cluster.worker_shell import WorkerShell
from decode_worker.core import ProcessCore, ThreadCore
from decode_worker.engine_loop import Frame, build_engine
from decode_worker.kv_intake import KVIntake
from decode_worker.steps import EngineFailed, Link, Outputs, speculation_stats, tokens_message
from decode_worker.text import RequestOutput

Core = ThreadCore | ProcessCore
ENGINE_FAILED = "the decode engine failed; see the worker's log"
Handed = dict[Link, list[RequestOutput]]  # a step's outputs by the step stream they go to


@dataclass
class OnLink:
    """A request a router placed here through its step stream."""

    link: Link
    parent: object  # its trace context
    submitted: float
    remote: bool
    first_at: float = 0.0


class DecodeWorker(WorkerShell[Core]):
    server_options = TCP_READ_OPTIONS

    def __init__(
        self,
        engine: Core,
        intake: KVIntake,
        worker_id: str,
        groups: CollectiveGroups | None = None,
        telemetry: Telemetry | None = None,
        auth: AuthConfig | None = None,
        wedged_after_s: float = 30.0,
    ) -> None:
        super().__init__(engine, worker_id, groups, telemetry, auth, wedged_after_s)
        self.intake = intake
        if isinstance(engine, ProcessCore):
            engine.on_exit = self._core_died
        self._streams: dict[str, Outputs] = {}
        self._links: dict[str, OnLink] = {}  # requests placed through a router's step stream
        self._early: dict[str, list[RequestOutput]] = {}  # outputs of transfers admitted before their Submit
        self._abandoned: set[str] = set()  # remote-prefill requests whose caller left before the KV arrived

    # -- lifecycle: the shell's, with the KV transfer service and its intake -----------------------

    def _add_services(self, server: grpc.aio.Server) -> list[str]:
        server.add_generic_rpc_handlers((handlers(KVTransferService(self.intake, self.groups)),))
        return ["tandem.v1.KVTransfer"]

    def _on_start(self) -> None:
        self.intake.start()

    def _before_server_stop(self) -> None:
        self.intake.close()

    def _after_server_stop(self) -> None:
        self.engine.stop()

    # -- the Worker service ------------------------------------------------------------------------

    async def Submit(
        self, request: worker_pb2.WorkerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.WorkerTokens]:
        submitted = time.time()
        parent = extract(context.invocation_metadata())
        rid = request.request_id
        waiting = self.engine.occupancy.waiting + self.intake.in_flight
        max_waiting = self.engine.scheduler_config.max_waiting
        params = await admit_submit(context, self.worker_id, self._draining, request.sampling, waiting, max_waiting)
        stream = Outputs()
        with self._lock:
            taken = rid in self._streams
            if not taken:
                self._streams[rid] = stream
                for out in self._early.pop(rid, []):
                    stream.put(out)
        if taken:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already streaming here")
        finished = False
        try:
            if not request.remote_prefill:
                prompt, output = list(request.prompt_token_ids), list(request.output_token_ids)
                try:
                    await self.in_front(self.engine.add_request, rid, prompt, params, output)
                except (ValueError, UnknownAdapter) as e:
                    await context.abort(refusal_code(e), str(e))
            first_at = None
            while not finished:
                try:
                    out = await stream.next()
                except EngineFailed:
                    await context.abort(grpc.StatusCode.INTERNAL, ENGINE_FAILED)
                first_at = first_at or time.time()
                finished = out.finished
                yield tokens_message(out)
            self._observe(parent, rid, request.remote_prefill, submitted, first_at, out)
        finally:  # however the call ends: a finished request is forgotten, anything else aborted
            if finished:
                self._forget(rid)
            else:
                self._cancel_soon(rid, request.remote_prefill)

    async def Steps(
        self, commands: AsyncIterator[worker_pb2.StepCommand], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.StepFrame]:
        link = Link()
        reader = asyncio.create_task(self._read_commands(commands, link))
        try:
            async for frame in link.frames():
                yield frame
            if link.failed is not None:
                await context.abort(*link.failed)
        finally:  # the router is gone (or this worker stops): nothing of its requests is wanted here
            reader.cancel()
            link.close()
            with self._lock:
                left = [rid for rid, placed in self._links.items() if placed.link is link]
            for rid in left:
                self._cancel_soon(rid)

    async def _read_commands(self, commands: AsyncIterator[worker_pb2.StepCommand], link: Link) -> None:
        try:
            async for command in commands:
                if command.HasField("submit"):
                    self._submit_on(link, command.submit, command.trace)
                elif command.cancel:
                    self._cancel_soon(command.cancel)
                else:
                    link.close((grpc.StatusCode.INVALID_ARGUMENT, "a step command names neither a submit nor a cancel"))
                    return
        except grpc.RpcError:
            pass  # the call ended
        finally:
            link.close()

    def _submit_on(self, link: Link, request: worker_pb2.WorkerRequest, trace) -> None:  # type: ignore[no-untyped-def]
        """Submit's checks and start for a request that came up a step stream; a refusal is its end."""
        rid = request.request_id
        try:
            waiting = self.engine.occupancy.waiting + self.intake.in_flight + self.engine.unanswered
            max_waiting = self.engine.scheduler_config.max_waiting
            params = check_submit(self.worker_id, self._draining, request.sampling, waiting, max_waiting)
            with self._lock:
                if rid in self._streams or rid in self._links:
                    raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already streaming here")
                parent = extract(list(trace.items()))
                placed = self._links[rid] = OnLink(link, parent, time.time(), request.remote_prefill)
                early = self._early.pop(rid, [])
                if early:  # admitted before this command came: first, and in order
                    self._took(rid, placed, early)
            if not request.remote_prefill:

                def refused(e: Exception) -> None:
                    self._forget(rid)
                    link.end(rid, refusal_code(e), str(e))

                prompt, output = list(request.prompt_token_ids), list(request.output_token_ids)
                self.engine.submit(rid, prompt, params, output, refused)  # no wait: the stream's next submit goes on
        except Refused as e:
            link.end(rid, e.code, e.details)

    def remaining(self) -> int:
        o = self.engine.occupancy
        with self._lock:
            streams = len(self._streams) + len(self._links)  # with remote prefills still waiting for their KV
        return max(o.running + o.waiting, streams) + self.intake.in_flight

    def load(self) -> worker_pb2.WorkerLoad:
        o = self.engine.occupancy  # one consistent moment, read without waiting for a step
        m = self.telemetry.metrics
        m.kv_usage.set(o.kv_usage)
        m.running.set(o.running)
        m.waiting.set(o.waiting)
        m.preemptions.set(o.preemptions)
        m.prefix_hit_rate.set(o.prefix_hits / o.prefix_queries if o.prefix_queries else 0.0)
        m.observe_tiers(o.tiers)
        return worker_pb2.WorkerLoad(
            worker_id=self.worker_id,
            role="decode",
            running_seqs=o.running,
            waiting_seqs=o.waiting + self.intake.in_flight,
            queued_prompt_tokens=o.queued_prompt_tokens,
            free_kv_blocks=o.free_blocks,
            total_kv_blocks=o.total_blocks,
            draining=self._draining,
            metrics_address=self.telemetry.metrics.address or "",
            wedged=self.watchdog.wedged,
            tier_block_cost={c.tier: c.cost for c in o.tiers if c.cost is not None},
            tier_hit_blocks={c.tier: c.hits for c in o.tiers},
            adapters=adapters_message(o.adapters),
            max_loras=o.max_loras,
        )

    # -- internals ---------------------------------------------------------------------------------

    def _observe(self, parent, rid: str, remote: bool, submitted: float, first_at: float, out: RequestOutput) -> None:  # type: ignore[no-untyped-def]
        """Spans of one request here (its KV's admission, for a remote prefill, and its decode) and
        its speculative-decoding counts."""
        t = self.telemetry
        admitted = self.intake.admitted.pop(rid, None)
        if remote and admitted is not None:
            reserved_at, admitted_at, nbytes = admitted
            t.record(
                "decode.admit",
                parent,
                reserved_at,
                admitted_at,
                tandem__worker=self.worker_id,
                tandem__kv__bytes=nbytes,
            )
        start = submitted if not remote else (admitted[1] if admitted else first_at)
        spec = {}
        if out.num_draft_tokens:
            stats = speculation_stats(out)
            t.metrics.spec_draft_tokens.inc(stats.draft_tokens)
            t.metrics.spec_accepted_tokens.inc(stats.accepted_tokens)
            t.metrics.spec_tokens_per_pass.observe(stats.tokens_per_pass)
            spec = dict(
                tandem__spec__draft_tokens=stats.draft_tokens,
                tandem__spec__accepted_tokens=stats.accepted_tokens,
                tandem__spec__acceptance_rate=stats.acceptance_rate,
                tandem__spec__tokens_per_pass=stats.tokens_per_pass,
            )
        t.record(
            "decode", parent, start, time.time(), tandem__worker=self.worker_id,
            gen_ai__usage__output_tokens=out.num_output_tokens, gen_ai__response__finish_reasons=[out.finish_reason],
            tandem__prefill_mode="remote" if remote else "local", **spec, **loaded_attributes(out.loaded_from),
        )  # fmt: skip

    def _busy(self) -> bool:
        return self.engine.has_unfinished

    def _cancel(self, rid: str, awaiting_kv: bool = True) -> bool:
        """Aborts `rid` wherever it is: running, waiting, or its KV still on the way."""
        self._forget(rid)
        found = self.engine.abort(rid)
        if not found and awaiting_kv:
            with self._lock:
                self._abandoned.add(rid)  # if its transfer lands later, drop it then
        return found

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._streams.pop(rid, None)
            self._links.pop(rid, None)
            self._early.pop(rid, None)

    def _run(self) -> None:
        self.engine.run(self._on_frame, self._stop)

    def _on_frame(self, frame: Frame) -> None:
        """One turn of the engine loop: each output to its request's stream or step stream (one hand
        over per step stream); a failed step fails every request (the router moves them)."""
        self.watchdog.progress()
        if frame.failed is not None:
            with self._lock:
                streams = list(self._streams.values())
                placed = list(self._links.items())
            for stream in streams:
                stream.fail()
            for rid, on_link in placed:
                on_link.link.end(rid, grpc.StatusCode.INTERNAL, ENGINE_FAILED)
                self._forget(rid)
                self.engine.abort_soon(rid)  # this is the frame reader's thread: no answer awaited
            return
        finished: list[tuple[OnLink, RequestOutput]] = []
        with self._lock:
            by_link: dict[str, list[RequestOutput]] = {}
            for out in frame.outputs:
                if out.request_id in self._links:
                    by_link.setdefault(out.request_id, []).append(out)
                else:
                    self._route(out)
            handed: Handed = {}
            for rid, outs in by_link.items():
                finished += self._took(rid, self._links[rid], outs, handed)
            for link, outs in handed.items():
                link.put(outs)  # one hand over per step stream
        for placed, out in finished:
            self._observe(placed.parent, out.request_id, placed.remote, placed.submitted, placed.first_at, out)
        m = self.telemetry.metrics
        for waited in frame.first_tokens:
            if waited.tier_load_s:
                m.tier_wait.observe(waited.tier_load_s)
            m.queue.labels("decode").observe(waited.queue_s)
            m.local_prefill.observe(waited.prefill_s)

    def _took(
        self, rid: str, placed: OnLink, outputs: list[RequestOutput], handed: Handed | None = None
    ) -> list[tuple[OnLink, RequestOutput]]:
        """A step-stream request's outputs, for its link (under `_lock`): added to `handed` to go over
        with the rest of the step, or handed over now; a finished request leaves."""
        placed.first_at = placed.first_at or time.time()
        if handed is None:
            placed.link.put(outputs)
        else:
            handed.setdefault(placed.link, []).extend(outputs)
        if outputs[-1].finished:
            del self._links[rid]
            return [(placed, outputs[-1])]
        return []

    def _route(self, out: RequestOutput) -> None:
        """A Submit stream's output (under `_lock`), or one whose request has not come yet."""
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.put(out)
        elif out.request_id in self._abandoned:
            self._abandoned.discard(out.request_id)
            self.engine.abort_soon(out.request_id)  # this is the frame reader's thread: no answer awaited
        else:
            self._early.setdefault(out.request_id, []).append(out)


def from_config(config: ClusterConfig, worker_id: str) -> DecodeWorker:
    """A decode worker for the config's model, cache, batching and transfer settings (not started);
    its engine in a process of its own unless `scheduler.engine_core` is "thread"."""
    if config.scheduler.engine_core == "process":
        core: Core = ProcessCore.spawn(config, worker_id)
        return around(config, worker_id, core, core.info.fingerprint)
    engine = build_engine(config, text=False)  # its front applies the text, as over a core process
    return around(config, worker_id, ThreadCore(engine), engine.fingerprint)


def around(config: ClusterConfig, worker_id: str, core: Core, fingerprint: bytes) -> DecodeWorker:
    """The decode worker in front of `core`, an engine core already started (not started itself)."""
    t = config.transfer
    secret = config.auth.cluster_secret
    intake = KVIntake(
        core, fingerprint, timeout_s=t.timeout_s,
        capability_secret=secret.get_secret_value().encode() if secret else None,
    )  # fmt: skip
    m = config.model
    groups = CollectiveGroups(m.device, t.timeout_s, t.max_groups)
    telemetry = Telemetry(config.telemetry, f"tandem-{worker_id}")
    wedged = config.scheduler.wedged_after_s
    worker = DecodeWorker(core, intake, worker_id, groups, telemetry, config.auth, wedged)
    worker.adapter_reader = runtime_reader(config, intake.arch)
    return worker
