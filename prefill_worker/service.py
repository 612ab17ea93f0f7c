"""The prefill worker as a gRPC server: `tandem.v1.Worker` and health, on the shell both workers
share (`cluster.worker_shell`: the server's lifecycle, Abort, GetLoad, Watch, Drain).

Lifecycle of a request here:

    Submit(decode_target)   the prompt is queued on the prefill engine's core, its KV bound for the
                            decode worker at `decode_target` over the configured transport
    engine core             steps the engine while it has work and releases expired leases: in a
                            process of its own (`prefill_worker.core`), or a thread of this one
    the call answers        with the first token as soon as it is sampled, then ends once the decode
                            worker has admitted the sequence, or fails with the transfer's status
                            code; a cancelled call aborts the request and its transfer
    Watch                   each router's stream of this worker's load (`watch_loads`)

Submit and Watch run on the front's event loop (`grpc.aio`); the front reads the core's frames on a
thread of its own, and each first token goes to its Submit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future

import grpc
from tandem.v1 import api_pb2, worker_pb2

from cluster.config import AuthConfig, ClusterConfig, TransferConfig
from cluster.engine.adapters import runtime_reader
from cluster.engine.request import UnknownAdapter, logprob_entries
from cluster.grpc_server import adapters_message, admit_submit, refusal_code
from cluster.kv.transport import TransferState
from cluster.kv.wire import TransferError
from cluster.model.arch import ModelArch
from cluster.model.gguf import model_folder
from cluster.telemetry import Telemetry, extract, loaded_attributes
from cluster.worker_shell import WorkerShell
from prefill_worker.core import Frame, ProcessCore, ThreadCore, build_engine, senders_for
from prefill_worker.engine import PrefillOutput

Core = ThreadCore | ProcessCore


class PrefillWorker(WorkerShell[Core]):
    def __init__(
        self,
        engine: Core,
        transfer: TransferConfig,
        worker_id: str,
        telemetry: Telemetry | None = None,
        auth: AuthConfig | None = None,
        wedged_after_s: float = 30.0,
    ) -> None:
        super().__init__(engine, worker_id, None, telemetry, auth, wedged_after_s)  # the core holds the KV senders
        self.transfer = transfer
        self._waiters: dict[str, Future[tuple[PrefillOutput, float, float]]] = {}  # (output, step start, end)
        if isinstance(engine, ProcessCore):
            engine.on_exit = self._core_died

    def _after_server_stop(self) -> None:
        self.engine.stop()

    # -- the Worker service ------------------------------------------------------------------------

    async def Submit(
        self, request: worker_pb2.WorkerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.WorkerTokens]:
        submitted = time.time()
        parent = extract(context.invocation_metadata())
        rid = request.request_id
        if not request.decode_target:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a prefill request needs a decode_target")
        params = await admit_submit(
            context, self.worker_id, self._draining, request.sampling, self.engine.stats().waiting,
            self.engine.scheduler_config.max_waiting,
        )  # fmt: skip
        waiter: Future[tuple[PrefillOutput, float, float]] = Future()
        with self._lock:
            taken = rid in self._waiters
            if not taken:
                self._waiters[rid] = waiter  # first: its first token may come before the call returns
        if taken:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already prefilling here")
        done = False
        try:
            try:
                prompt, output = list(request.prompt_token_ids), list(request.output_token_ids)
                await self.in_front(
                    self.engine.add_request, rid, prompt, params, request.decode_target, request.capability,
                    output, request.decode_cached_tokens,
                )  # fmt: skip
            except (ValueError, UnknownAdapter) as e:
                done = True  # nothing of it is on the engine
                with self._lock:
                    self._waiters.pop(rid, None)
                await context.abort(refusal_code(e), str(e))
            try:
                out, step_start, step_end = await asyncio.wrap_future(waiter)
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                    raise  # the caller left
                return  # aborted here (`Abort`): `_cancel` already aborted the request
            except Exception as e:
                await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {e!r}")
            yield first_tokens(rid, out)  # at once: the router may stream it before the KV has landed
            state = await self.in_front(out.transfer.wait, self.transfer.timeout_s + self.transfer.lease_s)
            done = True
            self._observe(parent, out, submitted, step_start, step_end, time.time())
            if state is not TransferState.DONE:
                error = out.transfer.error or TransferError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer")
                await context.abort(error.code, f"KV transfer to {request.decode_target}: {error.message}")
        finally:
            if not done:  # the caller left: the request and its transfer go
                self._cancel_soon(rid)

    def remaining(self) -> int:
        stats = self.engine.stats()
        return stats.waiting + stats.prefilling + stats.leased

    def load(self) -> worker_pb2.WorkerLoad:
        stats = self.engine.stats()
        m = self.telemetry.metrics
        m.kv_usage.set(1 - stats.free_blocks / stats.total_blocks)
        m.running.set(stats.prefilling)
        m.waiting.set(stats.waiting)
        m.prefix_hit_rate.set(stats.prefix_hit_rate)
        m.observe_tiers(stats.tiers)
        return worker_pb2.WorkerLoad(
            worker_id=self.worker_id,
            role="prefill",
            running_seqs=stats.prefilling,
            waiting_seqs=stats.waiting,
            queued_prompt_tokens=stats.queued_tokens,
            free_kv_blocks=stats.free_blocks,
            total_kv_blocks=stats.total_blocks,
            draining=self._draining,
            metrics_address=self.telemetry.metrics.address or "",
            wedged=self.watchdog.wedged,
            tier_block_cost={c.tier: c.cost for c in stats.tiers if c.cost is not None},
            tier_hit_blocks={c.tier: c.hits for c in stats.tiers},
            adapters=adapters_message(stats.adapters),
            max_loras=stats.max_loras,
        )

    # -- internals ---------------------------------------------------------------------------------

    def _observe(self, parent, out: PrefillOutput, submitted: float, start: float, end: float, done: float) -> None:  # type: ignore[no-untyped-def]
        """Spans and metrics of one prefill: queue, compute (its last pass) and the KV transfer."""
        t, m, transport = self.telemetry, self.telemetry.metrics, self.transfer.transport
        stream = out.transfer
        t.record("prefill.queue", parent, submitted, start, tandem__worker=self.worker_id)
        t.record(
            "prefill.compute", parent, start, end, tandem__worker=self.worker_id,
            gen_ai__usage__input_tokens=out.num_prompt_tokens, tandem__cached_tokens=out.num_cached_tokens,
            **loaded_attributes(out.loaded_from),
        )  # fmt: skip
        error = stream.error
        t.record(
            "kv.transfer", parent, start, done, tandem__kv__transport=transport, tandem__kv__bytes=stream.bytes_sent,
            tandem__kv__state=stream.state.value, tandem__kv__error=str(error) if error else None,
        )  # fmt: skip
        m.queue.labels("prefill").observe(start - submitted)
        if error is None:
            m.kv_transfer.labels(transport).observe(done - start)
            m.kv_bytes.labels(transport).observe(stream.bytes_sent)
        else:
            m.transfer_failures.labels(error.code.name).inc()

    def _busy(self) -> bool:
        return self.engine.has_work

    def _cancel(self, rid: str) -> bool:
        with self._lock:
            waiter = self._waiters.pop(rid, None)
        found = self.engine.abort(rid)
        if waiter is not None and not waiter.done():
            waiter.cancel()
        return found

    def _run(self) -> None:
        self.engine.run(self._on_frame, self._stop)

    def _on_frame(self, frame: Frame) -> None:
        """One turn of the engine core: each first token to its Submit; a failed step (the core aborted
        every request) fails them all."""
        self.watchdog.progress()
        with self._lock:
            if frame.failed is not None:
                failed, self._waiters = list(self._waiters.values()), {}
            else:
                failed = []
                for out in frame.outputs:
                    waiter = self._waiters.pop(out.request_id, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result((out, frame.started, frame.ended))
        for waiter in failed:
            if not waiter.done():
                waiter.set_exception(RuntimeError(frame.failed))


def first_tokens(rid: str, out: PrefillOutput) -> worker_pb2.WorkerTokens:
    """A prefill's one message: its first token (with its logprobs, and the prompt's, when asked)."""
    logprobs = []
    if out.logprob is not None:
        top = [api_pb2.TopLogprob(token_id=t, logprob=v) for t, v in out.top_logprobs]
        logprobs = [api_pb2.TokenLogprob(token_id=out.first_token, logprob=out.logprob, top=top)]
    return worker_pb2.WorkerTokens(
        request_id=rid,
        token_ids=[out.first_token],
        logprobs=logprobs,
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        prompt_logprobs=logprob_entries(out.prompt_logprobs),
    )


def from_config(config: ClusterConfig, worker_id: str) -> PrefillWorker:
    """A prefill worker for the config's model, cache, batching and transfer settings (not started);
    its engine in a process of its own unless `scheduler.engine_core` is "thread"."""
    if config.transfer.transport == "local":
        raise ValueError('transfer.transport "local" needs prefill and decode in one process; use grpc or collective')
    if config.scheduler.engine_core == "process":
        core: Core = ProcessCore.spawn(config, worker_id)
    else:
        core = ThreadCore(build_engine(config), senders_for(config))
    telemetry = Telemetry(config.telemetry, f"tandem-{worker_id}")
    worker = PrefillWorker(core, config.transfer, worker_id, telemetry, config.auth, config.scheduler.wedged_after_s)
    worker.adapter_reader = runtime_reader(config, ModelArch.from_folder(model_folder(config.model.path)))
    return worker
