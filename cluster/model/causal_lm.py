"""A Llama-family decoder over a paged KV cache: Llama 2/3, Mistral, Qwen2, SmolLM.

RMSNorm, rotary embeddings (with Llama-3 scaling), grouped-query attention and a SwiGLU MLP.
The q/k/v and gate/up projections are fused into one matrix each (fewer, larger products per
step); `cluster.model.loader` maps Hugging Face's separate tensors into them.

Inputs are explicit: a flat batch of token ids with their positions, the KV cache, and the
attention metadata built once per pass (`cluster.model.attention`). Nothing here knows about the
device, the scheduler or quantisation.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model import cpu_kernels, prepack
from cluster.model.arch import ModelArch, RopeConfig
from cluster.model.attention import AttentionMetadata, KVCache, paged_attention
from cluster.model.lora import LayerLora, LoraBatch

# Compiled CPU products with at most this many rows are written as reductions where the CPU
# kernels are missing (see `Linear`).
REDUCTION_MAX_ROWS = 2


class Linear(nn.Linear):
    """`nn.Linear` whose CPU products with a few rows stream each weight row once.

    Decode multiplies one row per sequence (or per verified draft token) by every weight matrix, so
    a step is bound by reading the weights, and torch's GEMM kernels read them at a fraction of the
    bandwidth. Up to `cpu_kernels.SKINNY_ROWS[dtype]` rows go through `tandem_cpu::skinny_linear`,
    eager and compiled, which reads each weight row once for all of them (on CPUs with AVX-512:
    `cpu_kernels.used()`). Elsewhere compiled products with one or two rows are written as
    `(x * W).sum(-1)`, which inductor turns into one loop over the weight rows. More rows, eager,
    take the weight packed once for AMX tiles or oneDNN where `cluster.model.prepack` packed it.
    """

    prepacked: torch.Tensor | None = None  # `prepack.prepack`'s copy of the weight, if any
    prepacked_dtype: torch.dtype | None = None

    def native_parts(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """The tensors `tandem_cpu::skinny_linear` multiplies `x` [rows, in] by, and the bias, where this
        layer's product goes through it; else None. `tandem_cpu::decode_layers` takes them."""
        rows = x.shape[0] if x.dim() == 2 else 0
        on_cpu = rows > 0 and self.weight.device.type == "cpu" and x.dtype == self.weight.dtype
        if not on_cpu or x.requires_grad or rows > cpu_kernels.SKINNY_ROWS.get(x.dtype, 0) or not cpu_kernels.used():
            return None
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_parts(x) is not None:
            y = torch.ops.tandem_cpu.skinny_linear(x, self.weight)
            return y if self.bias is None else y + self.bias
        rows = x.shape[0] if x.dim() == 2 else 0
        on_cpu = rows > 0 and self.weight.device.type == "cpu" and x.dtype == self.weight.dtype
        few = on_cpu and not x.requires_grad and rows <= cpu_kernels.SKINNY_ROWS.get(x.dtype, 0)
        if on_cpu and not few and prepack.usable(self, x):
            return prepack.product(x, self.prepacked, self.bias)
        if not on_cpu or rows > REDUCTION_MAX_ROWS or not torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        # float32 row times bfloat16 weight: the widening happens inside the fused loop. An explicit
        # `weight.float()` would be folded into a float32 copy of the weights, doubling the bytes read.
        y = torch.stack([(x[i].float() * self.weight).sum(-1) for i in range(rows)])
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)


def fused_elementwise(x: torch.Tensor) -> bool:
    """Whether an eager CPU pass takes the kernels' one-pass element-wise steps (RMSNorm, rotary
    embedding, silu(gate) * up: `csrc/elementwise.h`) for `x`. A compiled graph fuses them itself,
    and training keeps torch's ops, which autograd differentiates."""
    return x.device.type == "cpu" and not x.requires_grad and not torch.compiler.is_compiling() and cpu_kernels.used()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == self.weight.dtype and fused_elementwise(x):
            return torch.ops.tandem_cpu.rms_norm(x, self.weight, self.eps)
        # Normalise in float32, as the reference implementation does, then scale in the model dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with linear or Llama-3 scaling applied, on the CPU (even
    under a meta-device model build, whose arithmetic would import torch's compiler)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type != "llama3":
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend the band between.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos, sin: [T, 1, head_dim], sin negated in its first half (see
    # `CausalLM.forward`). Rotates the two halves (Llama's layout): x * cos + (-x2, x1) * sin. The
    # halves are swapped by a roll, which the compiler indexes in place; a concatenation there
    # becomes a buffer and its aliases in the graph (about 0.25 ms of a batch-1 decode step).
    if x.dtype == cos.dtype and fused_elementwise(x):
        return torch.ops.tandem_cpu.rope(x, cos, sin)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        self.scale = self.head_dim**-0.5
        self.window = window

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x) if lora is None else lora.add(self.qkv_proj(x), x, "qkv")
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(-1, self.num_heads, self.head_dim), cos, sin)  # [T, heads, hd]
        k = apply_rope(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)  # [T, kv_heads, hd]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv, meta, self.scale, self.window)  # [T, heads * hd]
        return self.o_proj(out) if lora is None else lora.add(self.o_proj(out), out, "o")


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.intermediate = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * self.intermediate, bias=arch.mlp_bias)
        self.down_proj = Linear(self.intermediate, arch.hidden_size, bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x) if lora is None else lora.add(self.gate_up_proj(x), x, "gate_up")
        if gate_up.dim() == 2 and fused_elementwise(gate_up):
            h = torch.ops.tandem_cpu.silu_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            h = F.silu(gate) * up
        return self.down_proj(h) if lora is None else lora.add(self.down_proj(h), h, "down")


# Bumped where what a native decode pass keeps may be stale: a layer's state loaded, or a module put
# in another's place anywhere (torch's hook for every submodule set). `CausalLM.decode_natively`
# checks it once a step instead of asking thirty layers (0.6 ms of an 11 ms int8 step).
_native_version = [0]


def _forget_native(layer: DecoderLayer) -> None:
    layer._native.clear()
    _native_version[0] += 1


def _bump_native_version(*_: object) -> None:
    _native_version[0] += 1


nn.modules.module.register_module_module_registration_hook(_bump_native_version)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, window: int | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, window)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)
        self._native: dict[tuple[torch.dtype, int], tuple] = {}  # see `native_weights`
        self.register_load_state_dict_post_hook(lambda module, keys: _forget_native(module))

    def forward(self, x, cos, sin, kv, meta, lora=None):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)

    def native_weights(self, x: torch.Tensor) -> tuple | None:
        """This layer's weights for `tandem_cpu::decode_layers` at rows like `x`: its two norms' and each
        product's `native_parts`; None where a product takes another path. Kept per row count and
        dtype (building them took 1-2 ms of a 10 ms int8 step); a loaded state or a product module put
        in another's place builds them anew."""
        attn, mlp = self.self_attn, self.mlp
        modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        key = (x.dtype, x.shape[0])
        kept = self._native.get(key)
        if kept is not None and all(a is b for a, b in zip(kept[0], modules, strict=True)):
            return kept[1]
        products = [m.native_parts(x) for m in modules]
        norms = (self.input_layernorm.weight, self.post_attention_layernorm.weight)
        usable = all(p is not None for p in products) and all(n.dtype == x.dtype for n in norms)
        self._native[key] = (modules, (*norms, *products) if usable else None)
        return self._native[key][1]


class CausalLM(nn.Module):
    """The decoder stack plus the LM head. Parameter names follow `cluster.model.loader`'s table."""

    def __init__(self, arch: ModelArch, draw_weights: bool = True) -> None:
        """`draw_weights=False`: the embedding is left empty, not drawn at random, for a loader that
        fills every weight (drawing on the meta device imports torch's compiler, a second's work)."""
        super().__init__()
        self.arch = arch
        given = None if draw_weights else torch.empty(arch.vocab_size, arch.hidden_size)
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, _weight=given)
        self.layers = nn.ModuleList(DecoderLayer(arch, w) for w in arch.sliding_windows)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(arch.rope, arch.head_dim), persistent=False)
        self._native_pass: dict[tuple[torch.dtype, int], tuple] = {}  # `decode_natively`'s arguments, flat

    @property
    def windows(self) -> frozenset[int | None]:
        return frozenset(self.arch.sliding_windows)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        after_layer: Callable[[int], None] | None = None,  # told when each layer's KV is in the cache
        lora: LoraBatch | None = None,  # the adapters' updates, each token row through its own
    ) -> torch.Tensor:  # [T, hidden], final-normed
        x = self.embed_tokens(input_ids)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, hd/2], float32
        cos = torch.cat((freqs, freqs), dim=-1)[:, None, :].cos().to(x.dtype)  # [T, 1, hd]
        sin = torch.cat((-freqs, freqs), dim=-1)[:, None, :].sin().to(x.dtype)  # -sin, then sin
        if lora is None and after_layer is None:
            hidden = self.decode_natively(x, cos, sin, kv_cache, meta)
            if hidden is not None:
                return self.norm(hidden)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_cache, strict=True)):
            x = layer(x, cos, sin, kv, meta, None if lora is None else lora.layer(i))
            if after_layer is not None:
                after_layer(i)
        return self.norm(x)

    def decode_natively(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """The layers' pass over decode rows alone, eager, as one `tandem_cpu::decode_layers` call: the
        kernels the modules would call, called from C++, without some fifteen torch operations a layer
        dispatched from Python. None (the modules run) for prompt chunks, under torch.compile, without
        the CPU kernels, or where a layer's product takes another path."""
        if len(meta.groups) != 1 or meta.groups[0].max_new != 1 or not fused_elementwise(x):
            return None
        key = (x.dtype, x.shape[0])
        kept = self._native_pass.get(key)
        if kept is None or kept[0] != _native_version[0]:
            layers = [layer.native_weights(x) for layer in self.layers]
            if any(w is None for w in layers):
                kept = (_native_version[0], None, None)
            else:
                weights = [t for w in layers for t in (w[0], w[1], *w[2], *w[3], *w[4], *w[5])]
                kept = (_native_version[0], weights, [len(p) for w in layers for p in w[2:]])
            self._native_pass[key] = kept
        _, weights, counts = kept
        if weights is None:
            return None
        group, windows = meta.groups[0], list(meta.groups[0].masks)
        attn = self.layers[0].self_attn
        return torch.ops.tandem_cpu.decode_layers(
            x, weights, counts, cos, sin, [k for k, _ in kv_cache], [v for _, v in kv_cache], meta.slot_mapping,
            group.block_tables, list(group.masks.values()), [windows.index(w) for w in self.arch.sliding_windows],
            attn.num_heads, attn.num_kv_heads, attn.scale, self.layers[0].input_layernorm.eps,
        )  # fmt: skip

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        return self.lm_head(hidden).float()
