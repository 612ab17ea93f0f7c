"""LoRA adapters over the base model: read from PEFT's format, held in slots, applied row by row.

An adapter is a folder PEFT writes (`adapter_config.json` + `adapter_model.safetensors`): for some of the
seven projections of some layers, a low-rank pair A [r, in] and B [out, r], and the update
`x @ A.T @ B.T * scale` added to the base projection's output (scale = alpha / r, or alpha / sqrt(r) with
rsLoRA). `read_adapter` checks every tensor against the model and refuses, by name, what the forward pass
would not apply as PEFT does.

`LoraSlots` holds `max_loras` adapters at once in stacked buffers, every resident adapter in one tensor
per projection site, ranks zero-padded to `max_rank`. A pass with adapter rows takes a one-hot
`rows` [T, slots]: each row's update is the site's shrink over every slot, masked to its own slot, then
expanded (`Site.delta`). One product per site for the whole batch, of base rows and of every adapter's,
its shape fixed by the config, so a compiled decode graph serves any mix; the cost grows with
`max_loras * max_rank`, which is why both are bounded. Rows of the base model carry an all-zero row.

    slots = LoraSlots(arch, max_loras=4, max_rank=16, targets=TARGETS, dtype=torch.float32)
    slots.write(0, read_adapter(path, arch, max_rank=16))
    hidden = model(ids, positions, kv_cache, meta, lora=slots.batch(row_slots))   # -1: the base model
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from cluster.model.arch import ModelArch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The fused projections of `cluster.model.causal_lm` and the adapter targets each one's output is made of.
SITES = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


class AdapterError(ValueError):
    """An adapter Tandem cannot serve; the message names the adapter and what is wrong."""


@dataclass(frozen=True)
class Adapter:
    """One adapter's updates, scale folded into B: `(layer, target) -> (A [r, in], B [out, r])`."""

    name: str
    rank: int  # the largest of its modules'
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: bytes  # SHA-256 of its config and weights: its identity in KV block names

    @property
    def targets(self) -> frozenset[str]:
        return frozenset(target for _, target in self.weights)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """Each target's (in, out) features."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }  # fmt: skip


def read_adapter(
    path: str | Path, arch: ModelArch, max_rank: int, targets: tuple[str, ...] = TARGETS, name: str = ""
) -> Adapter:
    """The adapter in the PEFT folder `path`, checked against `arch`; raises AdapterError naming the
    problem (a missing file, a rank over `max_rank`, a target outside `targets` or the model, a tensor of
    the wrong shape, a PEFT feature the forward pass does not apply)."""
    folder, name = Path(path), name or Path(path).name
    config = _read_config(folder, name)
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    tensors = _read_tensors(folder, name)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA update of a decoder layer's projection")
        layer, target = int(m[1]), m[2]
        if target not in TARGETS:
            raise AdapterError(f"adapter {name!r}: target {target!r} is not one of the model's {', '.join(TARGETS)}")
        if target not in targets:
            enabled = ", ".join(targets)
            raise AdapterError(f"adapter {name!r}: target {target!r} is not enabled (lora.targets: {enabled})")
        if layer >= arch.num_layers:
            raise AdapterError(f"adapter {name!r}: {key!r} names layer {layer}; the model has {arch.num_layers}")
        pairs.setdefault((layer, target), {})[m[3]] = tensor
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {folder / WEIGHTS_FILE} holds no LoRA update")
    weights, io = {}, shapes(arch)
    for (layer, target), pair in sorted(pairs.items()):
        where = f"adapter {name!r}: layer {layer} {target}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where} has lora_{'A' if 'A' not in pair else 'B'} missing")
        a, b = pair["A"], pair["B"]
        rank, (fan_in, fan_out) = a.shape[0], io[target]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, rank):
            raise AdapterError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the model's "
                f"({fan_out}, {fan_in}) projection: an adapter for another base model?"
            )
        if rank > max_rank:
            raise AdapterError(f"{where}: rank {rank} is over lora.max_rank {max_rank}")
        scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        weights[(layer, target)] = (a.float(), b.float() * scale)
    digest = hashlib.sha256((folder / CONFIG_FILE).read_bytes() + (folder / WEIGHTS_FILE).read_bytes()).digest()
    return Adapter(name, max(a.shape[0] for a, _ in weights.values()), weights, digest)


def _read_config(folder: Path, name: str) -> dict:  # type: ignore[type-arg]
    if not (folder / CONFIG_FILE).is_file():
        raise AdapterError(f"adapter {name!r}: {folder / CONFIG_FILE} is missing")
    if not (folder / WEIGHTS_FILE).is_file():
        raise AdapterError(f"adapter {name!r}: {folder / WEIGHTS_FILE} is missing")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"adapter {name!r}: {folder / CONFIG_FILE} is not JSON: {e}") from None
    refused = [
        (config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r} (only LORA)"),
        (bool(config.get("use_dora")), "use_dora (DoRA's magnitude vectors)"),
        (config.get("bias", "none") != "none", f"bias {config.get('bias')!r} (only 'none')"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out"),
        (bool(config.get("modules_to_save")), f"modules_to_save {config.get('modules_to_save')}"),
        (bool(config.get("alpha_pattern")), "alpha_pattern"),
    ]
    for bad, what in refused:
        if bad:
            raise AdapterError(f"adapter {name!r}: {what} is not supported")
    return config


def _read_tensors(folder: Path, name: str) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"adapter {name!r}: cannot read {folder / WEIGHTS_FILE}: {e}") from None


@dataclass(frozen=True)
class Site:
    """The resident adapters' updates of one fused projection of one layer.

    `a` [slots * parts * rank, in] stacks every slot's A of each part (a target the site's output is
    made of); `b[j]` [out_j, slots * rank] every slot's B of part j, or None for a part no adapter may
    target (its update is zero)."""

    a: torch.Tensor
    b: tuple[torch.Tensor | None, ...]
    outs: tuple[int, ...]  # each part's output features
    rank: int

    def delta(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # x [T, in], rows [T, slots] -> [T, out]
        t, slots, parts = x.shape[0], rows.shape[1], sum(b is not None for b in self.b)
        shrunk = (x @ self.a.t()).view(t, slots, parts, self.rank) * rows[:, :, None, None]  # each row its own slot
        deltas, j = [], 0
        for b, out in zip(self.b, self.outs, strict=True):
            if b is None:
                deltas.append(x.new_zeros(t, out))
                continue
            deltas.append(shrunk[:, :, j].reshape(t, slots * self.rank) @ b.t())  # [T, out_j]
            j += 1
        return deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1)


@dataclass(frozen=True)
class LayerLora:
    """One layer's sites and each token row's slot, one-hot [T, slots] in the model's dtype."""

    sites: dict[str, Site]
    rows: torch.Tensor

    def add(self, y: torch.Tensor, x: torch.Tensor, site: str) -> torch.Tensor:
        """`y`, the base projection of `x` at `site`, plus each row's update there."""
        s = self.sites.get(site)
        return y if s is None else y + s.delta(x, self.rows)


@dataclass(frozen=True)
class LoraBatch:
    """What one forward pass needs: the sites of every layer and each token row's slot (one-hot)."""

    sites: tuple[dict[str, Site], ...]  # per layer: site name -> Site
    rows: torch.Tensor  # [T, slots] in the model's dtype

    def layer(self, i: int) -> LayerLora:
        return LayerLora(self.sites[i], self.rows)

    def padded(self, rows: int) -> LoraBatch:
        """The same with base-model rows added up to `rows` (a compiled bucket's padding)."""
        extra = self.rows.new_zeros(rows - self.rows.shape[0], self.rows.shape[1])
        return LoraBatch(self.sites, torch.cat([self.rows, extra]))


class LoraSlots:
    """`max_loras` adapters resident at once, in stacked buffers (see the module's docstring)."""

    def __init__(
        self,
        arch: ModelArch,
        max_loras: int,
        max_rank: int,
        targets: tuple[str, ...],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        unknown = set(targets) - set(TARGETS)
        if unknown:
            raise ValueError(f"lora.targets: {', '.join(sorted(unknown))} not among {', '.join(TARGETS)}")
        self.max_loras, self.max_rank, self.targets, self.dtype = max_loras, max_rank, tuple(targets), dtype
        self.arch = arch
        io = shapes(arch)

        def site(parts: tuple[str, ...]) -> Site:
            width = max_loras * max_rank
            a = torch.zeros(width * sum(p in targets for p in parts), io[parts[0]][0], dtype=dtype, device=device)
            b = [torch.zeros(io[p][1], width, dtype=dtype, device=device) if p in targets else None for p in parts]
            return Site(a, tuple(b), tuple(io[p][1] for p in parts), max_rank)

        self.sites: tuple[dict[str, Site], ...] = tuple(
            {name: site(parts) for name, parts in SITES.items() if any(p in targets for p in parts)}
            for _ in range(arch.num_layers)
        )

    def write(self, slot: int, adapter: Adapter | None) -> None:
        """Puts `adapter` into `slot` (None empties it): every update it lacks is zero there."""
        r = self.max_rank
        for layer, sites in enumerate(self.sites):
            for name, site in sites.items():
                parts = [p for p in SITES[name] if p in self.targets]
                a = site.a.view(self.max_loras, len(parts), r, -1)
                for j, target in enumerate(parts):
                    a[slot, j].zero_()
                    b = site.b[SITES[name].index(target)]
                    assert b is not None
                    b[:, slot * r : (slot + 1) * r].zero_()
                    pair = adapter.weights.get((layer, target)) if adapter is not None else None
                    if pair is not None:
                        rank = pair[0].shape[0]
                        a[slot, j, :rank].copy_(pair[0])
                        b[:, slot * r : slot * r + rank].copy_(pair[1])

    def batch(self, row_slots: torch.Tensor) -> LoraBatch:
        """The pass's `LoraBatch` for token rows in these slots ([T] int64, -1: the base model)."""
        rows = torch.zeros(row_slots.shape[0], self.max_loras + 1, dtype=self.dtype, device=row_slots.device)
        rows[torch.arange(row_slots.shape[0], device=row_slots.device), row_slots] = 1  # -1 lands in the last column
        return LoraBatch(self.sites, rows[:, : self.max_loras])

    @property
    def nbytes(self) -> int:
        sites = [s for layer in self.sites for s in layer.values()]
        return sum(s.a.nbytes + sum(b.nbytes for b in s.b if b is not None) for s in sites)
