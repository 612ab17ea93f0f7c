"""The prefill worker as a gRPC server: `tandem.v1.Worker` and health, on the shell both workers
share (`cluster.worker_shell`: the server's lifecycle, Abort, GetLoad, Watch, Drain).

Lifecycle of a request here:

    Submit(decode_target)   the prompt is queued on the prefill engine, its KV bound for the decode
                            worker at `decode_target` over the configured transport
    engine loop thread      steps the engine while it has work and releases expired leases
    the call answers        with the first token as soon as it is sampled, then ends once the decode
                            worker has admitted the sequence, or fails with the transfer's status
                            code; a cancelled call aborts the request and its transfer
    Watch                   each router's stream of this worker's load (`watch_loads`)

The engine is stepped by one thread; Submit and Abort reach it through the worker's lock.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import CancelledError, Future

import grpc
from tandem.v1 import api_pb2, worker_pb2

from cluster.auth import secret_metadata
from cluster.config import AuthConfig, ClusterConfig, TransferConfig
from cluster.engine.model_runner import num_kv_blocks
from cluster.engine.structured import for_tokenizer
from cluster.grpc_server import admit_submit
from cluster.kv.collective import CollectiveGroups
from cluster.kv.grpc_transport import CollectiveSender, GrpcSender
from cluster.kv.transport import KVSender, TransferState
from cluster.telemetry import Telemetry, extract
from cluster.tls import channel_credentials
from cluster.worker_shell import WorkerShell, load_model_and_tokenizer
from prefill_worker.engine import PrefillEngine, PrefillOutput

LEASE_POLL_S = 0.05  # how often an idle prefill worker releases the blocks of transfers that ended


class PrefillWorker(WorkerShell[PrefillEngine]):
    groups: CollectiveGroups  # always: a collective transport's senders join their groups through it

    def __init__(
        self,
        engine: PrefillEngine,
        transfer: TransferConfig,
        worker_id: str,
        groups: CollectiveGroups | None = None,  # on the CPU when not given
        telemetry: Telemetry | None = None,
        auth: AuthConfig | None = None,
        wedged_after_s: float = 30.0,
    ) -> None:
        if groups is None:
            groups = CollectiveGroups("cpu", transfer.timeout_s, transfer.max_groups)
        super().__init__(engine, worker_id, groups, telemetry, auth, wedged_after_s)
        self.transfer = transfer
        self._senders: dict[str, KVSender] = {}  # under the shell's lock, with the engine and the waiters
        self._waiters: dict[str, Future[tuple[PrefillOutput, float, float]]] = {}  # (output, step start, end)

    def _after_server_stop(self) -> None:
        for sender in self._senders.values():
            sender.close()  # type: ignore[attr-defined]

    # -- the Worker service ------------------------------------------------------------------------

    def Submit(
        self, request: worker_pb2.WorkerRequest, context: grpc.ServicerContext
    ) -> Iterator[worker_pb2.WorkerTokens]:
        submitted = time.time()
        parent = extract(context.invocation_metadata())
        rid = request.request_id
        if not request.decode_target:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a prefill request needs a decode_target")
        params = admit_submit(
            context, self.worker_id, self._draining, request.sampling, self.engine.stats().waiting,
            self.engine.scheduler_config.max_waiting,
        )  # fmt: skip
        waiter: Future[tuple[PrefillOutput, float, float]] = Future()
        with self._lock:
            try:
                sender = self._sender(request.decode_target)
                prompt, output = list(request.prompt_token_ids), list(request.output_token_ids)
                self.engine.add_request(
                    rid, prompt, params, sender, request.capability, output, request.decode_cached_tokens
                )
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            self._waiters[rid] = waiter
        done = False
        context.add_callback(lambda: None if done else self._cancel(rid))
        try:
            out, step_start, step_end = waiter.result()
        except CancelledError:
            return  # the caller left; `_cancel` already aborted the request
        except Exception as e:
            context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {e!r}")
        logprobs = []
        if out.logprob is not None:
            top = [api_pb2.TopLogprob(token_id=t, logprob=v) for t, v in out.top_logprobs]
            logprobs = [api_pb2.TokenLogprob(token_id=out.first_token, logprob=out.logprob, top=top)]
        yield worker_pb2.WorkerTokens(  # at once: the router may stream it before the KV has landed
            request_id=rid,
            token_ids=[out.first_token],
            logprobs=logprobs,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
        )
        state = out.transfer.wait(self.transfer.timeout_s + self.transfer.lease_s)
        self._observe(parent, out, submitted, step_start, step_end, time.time())
        if state is not TransferState.DONE:
            error = out.transfer.error
            code, message = (error.code, error.message) if error else (grpc.StatusCode.DEADLINE_EXCEEDED, "no answer")
            context.abort(code, f"KV transfer to {request.decode_target}: {message}")
        done = True

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
        return self.engine.scheduler.has_work

    def _sender(self, target: str) -> KVSender:
        sender = self._senders.get(target)
        if sender is None:
            t = self.transfer
            metadata, creds = secret_metadata(self.auth), channel_credentials(self.auth)
            if t.transport == "collective":
                sender = CollectiveSender(target, self.groups, t.timeout_s, t.max_queued_chunks, metadata, creds)
            else:
                mib = t.max_message_mib << 20
                sender = GrpcSender(target, t.timeout_s, mib, t.max_queued_chunks, metadata, creds)
            self._senders[target] = sender
        return sender

    def _cancel(self, rid: str) -> bool:
        with self._lock:
            waiter = self._waiters.pop(rid, None)
            found = self.engine.abort(rid)
        if waiter is not None and not waiter.done():
            waiter.cancel()
        return found

    def _run(self) -> None:
        while not self._stop.is_set():
            self.watchdog.progress()
            seen = self.engine.changes.version  # read first: a change from here on wakes the wait below
            with self._lock:
                busy = self.engine.scheduler.has_work
                try:
                    step_start = time.time()
                    outputs = self.engine.step() if busy else []
                    step_end = time.time()
                except Exception as e:  # a failed pass fails every waiting call, loudly
                    for rid, waiter in list(self._waiters.items()):
                        self.engine.abort(rid)
                        if not waiter.done():
                            waiter.set_exception(e)
                    self._waiters.clear()
                    outputs = []
                if not busy:
                    self.engine.poll_leases()
                for out in outputs:
                    waiter = self._waiters.pop(out.request_id, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result((out, step_start, step_end))
            if not busy:  # asleep until a request arrives, waking to release the leases that ended
                self.engine.changes.wait(seen, LEASE_POLL_S)


def from_config(config: ClusterConfig, worker_id: str) -> PrefillWorker:
    """A prefill worker for the config's model, cache, batching and transfer settings (not started)."""
    m = config.model
    if config.transfer.transport == "local":
        raise ValueError('transfer.transport "local" needs prefill and decode in one process; use grpc or collective')
    model, tokenizer = load_model_and_tokenizer(m)
    eos = tokenizer.eos_token_ids
    num_blocks = num_kv_blocks(model, config.cache)
    grammars = for_tokenizer(tokenizer, model.arch.vocab_size, eos)
    engine = PrefillEngine(
        model, config.cache, config.scheduler, config.transfer, num_blocks, eos, seed=m.seed, grammars=grammars
    )
    t = config.transfer
    groups = CollectiveGroups(m.device, t.timeout_s, t.max_groups)
    telemetry = Telemetry(config.telemetry, f"tandem-{worker_id}")
    wedged = config.scheduler.wedged_after_s
    return PrefillWorker(engine, t, worker_id, groups, telemetry, config.auth, wedged)
