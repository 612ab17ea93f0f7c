"""The engine core process's side: the engine it builds, and the loop that steps it.

    core_main(commands, events, config)   the process's entry (`decode_worker.core.ProcessCore.spawn`
                                          starts it): builds and warms up the engine, says hello
                                          with its `CoreInfo`, then runs the `EngineLoop`
    EngineLoop                            the one thread stepping the engine: commands between steps,
                                          one `Frame` after each turn that changed anything, asleep
                                          on its commands when idle

The pipe between the core and its front, and what both ends do alike (the commands, the `Outbox`
that writes frames beside the next step), are `cluster.engine.core_process`'s. A `Frame` and a
`CoreInfo` are what the core tells its front; the front's handles are in `decode_worker.core`. No
gRPC, no tokenizer's text and no server threads run here.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster import startup
from cluster.config import ClusterConfig
from cluster.engine.changes import Occupancy
from cluster.engine.core_process import IDLE_WAKE_S, CoreLoop, say_hello
from cluster.engine.kv_events import KVBatch
from cluster.engine.request import FirstToken
from cluster.model.arch import ModelArch
from decode_worker.engine import Engine
from decode_worker.text import RequestOutput, pack_outputs, unpack_outputs

log = logging.getLogger(__name__)


@dataclass
class Frame:
    """What one turn of the engine loop tells its front: the step's outputs (none for a turn that
    only applied commands), the load after it, the prefix cache's events since the last frame, and
    whether work remains. `failed` carries a step's error: every request in flight has lost its step."""

    outputs: list[RequestOutput] = field(default_factory=list)
    occupancy: Occupancy = field(default_factory=Occupancy)
    kv: KVBatch | None = None
    busy: bool = False
    failed: str | None = None
    steps: int = 0  # the engine's steps so far
    taken: int = -1  # the last command the core applied (its call id; commands come in id order)
    first_tokens: list[FirstToken] = field(default_factory=list)  # where this step's first tokens waited

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with its outputs as columns (`pack_outputs`): a frame of a few hundred outputs
        crosses the pipe several times faster than object by object."""
        return {**self.__dict__, "outputs": pack_outputs(self.outputs)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, outputs=unpack_outputs(state["outputs"]))


OnFrame = Callable[[Frame], None]


@dataclass(frozen=True)
class CoreInfo:
    """What the front needs to know of the engine once: the model's shape, the KV cache's (the
    tensors themselves in shared memory), and the batching limits."""

    arch: ModelArch
    block_size: int
    kv_cache: list[tuple[Any, Any]]
    fingerprint: bytes = b""
    occupancy: Occupancy = field(default_factory=Occupancy)  # the load before any request


def build_engine(config: ClusterConfig, shared: bool = False, text: bool = True) -> Engine:
    """The decode engine for the config's model, cache and batching, warmed up. `shared`: its KV
    cache in shared memory, for a front in another process to write transfers into; `text=False`:
    its outputs' text left to its front (`CoreHandle`)."""
    # Here, not above: the front's KV intake imports this module, and a GPU check's process that has
    # neither OpenTelemetry (the worker shell's) nor a tokenizer's grammar library imports the intake.
    from cluster.engine.adapters import lora_part, startup_adapters
    from cluster.engine.speculative import build_proposer
    from cluster.engine.structured import for_tokenizer
    from cluster.worker_shell import load_model_and_tokenizer

    m = config.model
    with startup.phase("model"):
        model, tokenizer = load_model_and_tokenizer(m)
    spec = config.speculative
    with startup.phase("engine"):
        proposer = build_proposer(spec, model, config.cache.block_size, m.seed, m.compile_buckets)
        engine = Engine(
            model, tokenizer, config.cache, config.scheduler, tokenizer.eos_token_ids, m.max_model_len, seed=m.seed,
            compile_buckets=m.compile_buckets, proposer=proposer, num_speculative_tokens=spec.num_tokens,
            grammars=for_tokenizer(tokenizer, model.arch.vocab_size, tokenizer.eos_token_ids), shared_kv=shared,
            text=text, secret=config.auth.secret, lora=lora_part(config),
        )  # fmt: skip
        for adapter in startup_adapters(config, model):
            engine.load_adapter(adapter)
    with startup.phase("warm-up"):
        engine.warm_up()
    return engine


def core_main(commands, events, config_json: str) -> None:  # type: ignore[no-untyped-def]
    try:
        config = ClusterConfig.model_validate_json(config_json)
        engine = build_engine(config, shared=True, text=False)
        arch = engine.runner.model.arch
        info = CoreInfo(arch, config.cache.block_size, engine.kv_cache, engine.fingerprint, engine.occupancy)
    except BaseException as e:  # the front raises it: a bad model or config fails the worker's start
        events.send(RuntimeError(f"the engine core failed to start: {e!r}"))
        raise
    say_hello(events, info)
    EngineLoop(engine, commands, events).run()


class EngineLoop(CoreLoop):
    """The decode core's stepping thread: commands between steps, a frame after each turn that changed anything."""

    def __init__(self, engine: Engine, commands, events) -> None:  # type: ignore[no-untyped-def]
        super().__init__(engine, commands, events)
        self.cursor: int | None = None  # the journal's events the front has
        self.sent = engine.changes.version  # the change count the last frame (or the hello) told
        self.steps = 0

    def _turns(self) -> None:
        """Turns until `stop`."""
        engine = self.engine
        while True:
            idle = not engine.has_unfinished
            if self.commands.poll(IDLE_WAKE_S if idle else 0) and not self._apply_commands():
                return
            outputs: list[RequestOutput] = []
            failed = None
            if engine.has_unfinished:
                try:
                    outputs = engine.step()
                    self.steps += 1
                except Exception:
                    log.exception("the decode engine's step failed")
                    failed = traceback.format_exc(limit=3)
            if outputs or failed or engine.changes.version != self.sent:
                self._send_frame(outputs, failed)

    def _send_frame(self, outputs: list[RequestOutput], failed: str | None = None) -> None:
        engine = self.engine
        self.sent = engine.changes.version
        batch = engine.kv_journal.since(self.cursor)
        if batch is not None:
            self.cursor = batch.last
        waits = engine.take_first_tokens()
        self.outbox.send(
            Frame(outputs, engine.occupancy, batch, engine.has_unfinished, failed, self.steps, self.taken, waits)
        )

    def _before_answer(self) -> None:
        if self.engine.changes.version != self.sent:
            self._send_frame([])
