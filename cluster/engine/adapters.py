"""The LoRA adapters an engine serves: the catalogue, and which of them sit in the model's slots.

    adapters = Adapters.build(model, config.lora)
    adapters.add(read_adapter(path, arch, max_rank))   # read and checked off the step path, by the caller
    resolve(adapters, request)                         # its adapter's digest (UnknownAdapter if not loaded)
    batch = adapters.batch(plan.chunks)                # before a pass: the rows' slots, adapters written in
    adapters.remove(name, now)                         # new requests refused; running ones finish
    adapters.sweep(live_names, now)                    # after a step: removed adapters nothing runs through go

The catalogue holds every loaded adapter in host memory; `LoraSlots` holds `max_loras` of them where the
forward pass reads them. `batch` makes a pass's adapters resident, writing a missing one over an empty
slot or else the least recently used one the pass does not need (a copy of a few megabytes, never a
file read). The schedulers admit a request only while the distinct adapters of what runs fit the slots
(`cluster.engine.request.adapters_fit`), so a pass never needs more. Methods run under the engine's lock,
between steps.

A removed adapter still serves what is in flight: requests already here, and for `retire_grace_s` the KV
transfers of requests a prefill worker took before it was removed there (`resolve(..., in_flight=True)`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import torch

from cluster.config import ClusterConfig, LoraConfig
from cluster.engine.changes import AdapterState
from cluster.engine.request import Request, ScheduledChunk, UnknownAdapter
from cluster.model.arch import ModelArch
from cluster.model.causal_lm import CausalLM
from cluster.model.lora import Adapter, LoraBatch, LoraSlots, read_adapter

RETIRE_GRACE_S = 30.0  # a removed adapter takes KV transfers this long (a prefill worker's requests in flight)


class Adapters:
    def __init__(self, slots: LoraSlots) -> None:
        self.slots = slots
        self.catalogue: dict[str, Adapter] = {}
        self.retiring: dict[str, tuple[Adapter, float]] = {}  # removed (and when), kept while in flight
        self.retire_grace_s = RETIRE_GRACE_S
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self.loads = 0  # adapters written into a slot
        self.evictions = 0  # resident adapters written over

    @classmethod
    def build(cls, model: CausalLM, config: LoraConfig) -> Adapters:
        """Empty slots for `model`, in its weights' dtype and device."""
        weight = model.embed_tokens.weight
        slots = LoraSlots(model.arch, config.max_loras, config.max_rank, config.targets, weight.dtype, weight.device)
        return cls(slots)

    @property
    def max_loras(self) -> int:
        return self.slots.max_loras

    def add(self, adapter: Adapter) -> None:
        if adapter.name in self.catalogue or adapter.name in self.retiring:
            raise ValueError(f"adapter {adapter.name!r} is already loaded")
        self.catalogue[adapter.name] = adapter

    def remove(self, name: str, now: float) -> None:
        """Takes `name` out of the catalogue: new requests naming it are refused from now on, and those
        in flight finish (`sweep` frees its slot once none is left)."""
        adapter = self.catalogue.pop(name, None)
        if adapter is None:
            raise UnknownAdapter(name)
        self.retiring[name] = (adapter, now)

    def sweep(self, live: Iterable[str], now: float) -> None:
        """Drops the removed adapters that no request in `live` (the adapters of every request the engine
        holds) runs through and whose grace for transfers in flight is over, emptying their slots."""
        for name in set(self.retiring) - set(live):
            if now - self.retiring[name][1] >= self.retire_grace_s:
                del self.retiring[name]
                slot = self.resident.pop(name, None)
                if slot is not None:
                    self.slots.write(slot, None)

    def states(self) -> tuple[AdapterState, ...]:
        """Every adapter served, and those removed still finishing what is in flight, for the worker's load."""
        serving = [AdapterState(n, a.digest, n in self.resident) for n, a in self.catalogue.items()]
        retiring = [AdapterState(n, a.digest, n in self.resident, True) for n, (a, _) in self.retiring.items()]
        return tuple(sorted(serving + retiring, key=lambda a: a.name))

    def digest(self, name: str, in_flight: bool = False) -> bytes:
        """The identity `name`'s KV is named by; b"" for the base model (""). `in_flight`: a removed
        adapter still serves (a transfer of a request taken before it was removed)."""
        if not name:
            return b""
        adapter = self.catalogue.get(name)
        if adapter is None and in_flight and name in self.retiring:
            adapter = self.retiring[name][0]
        if adapter is None:
            raise UnknownAdapter(name)
        return adapter.digest

    def batch(self, chunks: Sequence[ScheduledChunk]) -> LoraBatch | None:
        """The pass's adapters, each chunk's token rows through its request's; None when every row is
        the base model's."""
        names = [c.request.params.adapter for c in chunks]
        needed = set(names) - {""}
        if not needed:
            return None
        slot_of = self._place(needed)
        slots = torch.tensor([slot_of.get(n, -1) for n in names], dtype=torch.long)
        counts = torch.tensor([c.num_new for c in chunks], dtype=torch.long)
        return self.slots.batch(slots.repeat_interleave(counts))

    def _place(self, needed: set[str]) -> dict[str, int]:
        if len(needed) > self.max_loras:
            raise RuntimeError(f"{len(needed)} adapters in one pass; the slots hold {self.max_loras}")
        for name in needed & self.resident.keys():
            self.resident.move_to_end(name)
        for name in sorted(needed - self.resident.keys()):
            adapter = self.catalogue.get(name) or self.retiring.get(name, (None, 0.0))[0]
            if adapter is None:
                raise UnknownAdapter(name)
            free = set(range(self.max_loras)) - set(self.resident.values())
            if free:
                slot = min(free)
            else:
                victim = next(n for n in self.resident if n not in needed)
                slot = self.resident.pop(victim)
                self.evictions += 1
            self.slots.write(slot, adapter)
            self.resident[name] = slot
            self.loads += 1
        return {name: self.resident[name] for name in needed}


def resolve(adapters: Adapters | None, request: Request, in_flight: bool = False) -> None:
    """Gives `request` its adapter's digest, which names its KV; UnknownAdapter if this engine has not
    loaded the adapter it names (or serves none). `in_flight`: a KV transfer's, which a removed adapter
    still takes for a while."""
    name = request.params.adapter
    if not name:
        return
    if adapters is None:
        raise UnknownAdapter(name)
    request.adapter = adapters.digest(name, in_flight)


def lora_part(config: ClusterConfig) -> LoraConfig | None:
    """The LoRA settings a worker's engine takes: None when it serves no adapter and loads none later."""
    return config.lora if config.model.adapters or config.lora.runtime_loading else None


def runtime_reader(config: ClusterConfig, arch: ModelArch) -> Callable[[str, str], Adapter] | None:
    """What reads and checks an adapter loaded while serving, `reader(name, path)`; None when
    `lora.runtime_loading` is off."""
    lora = config.lora
    if not lora.runtime_loading:
        return None
    return lambda name, path: read_adapter(path, arch, lora.max_rank, lora.targets, name)


def startup_adapters(config: ClusterConfig, model: CausalLM) -> list[Adapter]:
    """`model.adapters`, read and checked (AdapterError names the first bad one)."""
    lora, adapters = config.lora, config.model.adapters
    return [read_adapter(path, model.arch, lora.max_rank, lora.targets, name) for name, path in adapters.items()]
