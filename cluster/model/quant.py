"""Weight-only quantisation: fewer bytes per weight, read by kernels that take them as they are.

Decode reads every weight once per step, so bytes per weight set its floor. `quantize(model, ...)`
swaps each `nn.Linear` of a built model for a module holding smaller weights, in place; the
layers' code does not change (nothing in the model asks whether it is quantised):

- `int8`: one signed byte per weight and one scale per output channel (symmetric, max-abs / 127);
  a product of up to `INT8_SKINNY_ROWS` rows goes through `tandem_cpu::skinny_linear_int8` where
  that is faster (`skinny`), which streams each weight row once and multiplies it in integers
  against the inputs quantised to int8 per block of 32 columns, as llama.cpp does (VNNI
  `vpdpbusd`, or AVX2 `vpmaddubsw`; `csrc/quantized_linear.cpp`); else torch's int8 weight-only
  kernel (`torch._weight_int8pack_mm`), which keeps the inputs as they are.
- `int4`: half a byte per weight, with a scale and an offset per `group_size` input columns of each
  output channel (asymmetric, min / max); under float32 activations a product of up to
  `INT4_SKINNY_ROWS` rows goes through `tandem_cpu::skinny_linear_int4` (the nibbles as stored,
  in integer dot products with the inputs quantised the same way),
  else torch's int4 kernel (`torch._weight_int4pack_mm_for_cpu`) over weights packed once at load
  (`torch._convert_weight_to_int4pack_for_cpu`).

A product of many rows (a prompt's chunk: `dense_from_rows` and more, 128 for int8, 256 for
int4) is bound by arithmetic, not by reading weights, and the weight-only kernels, which
dequantise every weight for every group of rows, run it at a fraction of the dense product's
rate; there the layer dequantises its weights once, in float32 rounded to the activations' dtype,
and runs the dense product (`dense`): 1.2x (int8) and 1.5x (int4) the unquantised product's time
at 512 rows, where the weight-only kernels took 2.5-2.9x.
Where `cluster.model.prepack` packed a layer (`prepacked`: its weights dequantised once, laid out
for AMX tiles or for oneDNN), every product of more than 16 rows runs on that copy instead, at the
unquantised rate.

Activations stay in the model's dtype (float32 or bfloat16). The embedding table is never
quantised (a step reads only its own tokens' rows); the LM head is by default (a decode step reads
it whole: for SmolLM-135M it is a fifth of the bytes). `save_quantized` / `load_model` round-trip a
quantised model through a folder: int4 weights are stored two per byte in their plain order, and
packed for the kernel at load.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from cluster.model import cpu_kernels, prepack

WEIGHT_DTYPES = ("auto", "int8", "int4")
GROUP_SIZES = (32, 64, 128, 256)
INT8_SKINNY_ROWS = 16  # up to how many rows an int8 product goes through `tandem_cpu::skinny_linear_int8`
INT4_SKINNY_ROWS = 16  # and an int4 one through `tandem_cpu::skinny_linear_int4`
Q8_0_BLOCK = 32  # input columns per scale of GGUF's Q8_0, which a kept file's int8 LM head keeps
LM_HEADS = (True, False, "int8")  # a quantised model's LM head: as its layers, in float, or Q8_0's int8 blocks


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], float32 scales [N]): w ≈ q * scales[:, None]."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 values in [0, 15] [N, K], float32 scales [N, K / g], float32 minimums [N, K / g]):
    w ≈ minimum + q * scale, per group of `group_size` input columns."""
    n, k = w.shape
    groups = w.float().view(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return q.view(n, k), scales, low


class Int8Linear(nn.Module):
    """int8 weights with a scale per output channel, or (`block_size`, GGUF's Q8_0 kept as it is) a
    scale per block of `Q8_0_BLOCK` input columns of each row."""

    dense_from_rows = 128  # rows from which a product dequantises its weights and runs dense (measured)
    prepacked: torch.Tensor | None = None  # the weights dequantised and packed by `prepack.prepack`, if any
    prepacked_dtype: torch.dtype | None = None

    def __init__(
        self, in_features: int, out_features: int, dtype: torch.dtype, bias: bool, block_size: int | None = None
    ) -> None:
        super().__init__()
        if block_size not in (None, Q8_0_BLOCK) or (block_size and in_features % block_size):
            raise ValueError(f"int8 blocks take {Q8_0_BLOCK} columns, dividing in_features ({in_features})")
        self.in_features, self.out_features, self.block_size = in_features, out_features, block_size
        scales = (out_features,) if block_size is None else (out_features, in_features // block_size)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(scales, dtype=dtype))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)
        # A float32 copy of the scales for the kernel, rebuilt whenever they are loaded: converting
        # them in every call took 0.3 ms a step for a block-scaled LM head's 900k bfloat16 scales,
        # and 2 % of an int8 step for SmolLM2's scales a row.
        self.scales_f32: torch.Tensor | None = None
        self.register_load_state_dict_post_hook(lambda module, keys: module._copy_scales())

    def _copy_scales(self) -> None:
        self.scales_f32 = self.scales.float().contiguous()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        w = linear.weight.detach()
        module = cls(linear.in_features, linear.out_features, w.dtype, linear.bias is not None)
        q, scales = quantize_int8(w)
        module.weight.copy_(q)
        module.scales.copy_(scales)
        module._copy_scales()
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach())
        return module

    def dense(self) -> torch.Tensor:
        """The weights dequantised, [N, K] in the activations' dtype (in float32, rounded once)."""
        if self.weight.device.type == "cpu" and cpu_kernels.used():  # one pass over the weights
            return torch.ops.tandem_cpu.dequantize_int8(self.weight, self.scales, self.scales.dtype)
        if self.block_size is None:
            return (self.weight.float() * self.scales.float()[:, None]).to(self.scales.dtype)
        blocks = self.weight.view(self.out_features, -1, self.block_size).float() * self.scales.float()[..., None]
        return blocks.view(self.out_features, self.in_features).to(self.scales.dtype)

    def _kernel_scales(self) -> torch.Tensor:
        return self.scales_f32 if self.scales_f32 is not None else self.scales

    def native_parts(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """The tensors `tandem_cpu::skinny_linear_int8` multiplies `x` [rows, in] by, and the bias, where
        this layer's product goes through it; else None. `tandem_cpu::decode_layers` takes them."""
        rows = x.shape[0] if x.dim() == 2 else 0
        if not 0 < rows <= INT8_SKINNY_ROWS or self.weight.device.type != "cpu":
            return None
        if not (cpu_kernels.used() if self.block_size is not None else skinny(x.dtype)):
            return None
        return [self.weight, self._kernel_scales(), *([] if self.bias is None else [self.bias])]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        rows = flat.shape[0]
        if self.native_parts(flat) is not None:
            y = torch.ops.tandem_cpu.skinny_linear_int8(flat, self.weight, self._kernel_scales())
        elif rows > INT8_SKINNY_ROWS and prepack.usable(self, flat):
            y = prepack.product(flat, self.prepacked, None)
        elif rows >= self.dense_from_rows or self.block_size is not None:  # no torch product takes block scales
            y = torch.nn.functional.linear(flat, self.dense())
        else:
            y = torch._weight_int8pack_mm(flat, self.weight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def skinny(dtype: torch.dtype, bits: int = 8) -> bool:
    """Whether a quantised layer's few-row product goes through Tandem's kernel
    (`tandem_cpu::skinny_linear_int8`, `_int4`) rather than torch's, where the CPU kernels run; as
    measured on SmolLM2 steps at batch 1 (A/B in one process):
    - float32 activations, what an AVX2 machine runs: always; torch's quantised products are slow
      there (int8 60.9 against 8.4 ms a step compiled; int4 139.8 against 6.9);
    - bfloat16, int8: eager (13.9 against 18.5 ms); compiled on a CPU with AMX tiles (7.1-8.9 against
      9.5-9.7 ms on an Intel Xeon, where inductor's int8 product reads its weights at 18 GB/s, and the
      LM head, which it leaves to `torch._weight_int8pack_mm`, at 12), but not elsewhere: on an AMD
      Zen 4 inductor's own was faster in a compiled graph (6.9 against 7.7, before the kernel took
      up to four input rows against four weight rows at a time);
    - bfloat16, int4: never; torch's int4 product is as fast at one row and faster at more (on the
      Xeon, `benchmarks/skinny_linear.py`: 17.1 against 17.0 GB/s at one row, 1.13-1.23x faster
      at 2 to 16; 6.8 against 6.7 ms a step compiled, 12.3 against 12.8 eager on a Zen 4), and keeps
      the inputs as they are."""
    if dtype == torch.bfloat16 and (bits == 4 or (torch.compiler.is_compiling() and not cpu_kernels.amx())):
        return False
    return cpu_kernels.used()


class Int4Linear(nn.Module):
    """Weights packed for torch's CPU int4 kernel; `packed` holds them as the kernel wants them and
    is rebuilt from the plain nibbles (`nibbles`, two per byte) whenever those are loaded."""

    dense_from_rows = 256  # unpacking the nibbles costs more than int8's widening: later than int8
    prepacked: torch.Tensor | None = None  # as `Int8Linear.prepacked`
    prepacked_dtype: torch.dtype | None = None

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, bias: bool, group_size: int) -> None:
        super().__init__()
        if group_size not in GROUP_SIZES or in_features % group_size:
            raise ValueError(f"int4 needs a group size in {GROUP_SIZES} dividing in_features ({in_features})")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = in_features // group_size
        self.register_buffer("nibbles", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=dtype))
        self.register_buffer("minimums", torch.empty(out_features, groups, dtype=dtype))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)
        self.packed: torch.Tensor | None = None  # the kernel's layout: derived, not saved
        self.scales_and_zeros: torch.Tensor | None = None
        self.scales_f32: torch.Tensor | None = None  # float32 copies, for `tandem_cpu::skinny_linear_int4`
        self.minimums_f32: torch.Tensor | None = None
        self.register_load_state_dict_post_hook(lambda module, keys: module.pack())

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> Int4Linear:
        w = linear.weight.detach()
        module = cls(linear.in_features, linear.out_features, w.dtype, linear.bias is not None, group_size)
        q, scales, low = quantize_int4(w, group_size)
        module.nibbles.copy_(q[:, 0::2] | (q[:, 1::2] << 4))
        module.scales.copy_(scales)
        module.minimums.copy_(low)
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach())
        module.pack()
        return module

    def values(self) -> torch.Tensor:
        """The 4-bit values, uint8 [N, K]."""
        out = torch.empty(self.out_features, self.in_features, dtype=torch.uint8, device=self.nibbles.device)
        out[:, 0::2] = self.nibbles & 0xF
        out[:, 1::2] = self.nibbles >> 4
        return out

    def pack(self) -> None:
        # The kernel computes (q - 8) * scale + zero; with zero = minimum + 8 * scale that is minimum + q * scale.
        self.packed = torch._convert_weight_to_int4pack_for_cpu(self.values().to(torch.int32), 1)
        zeros = self.minimums + 8 * self.scales
        self.scales_and_zeros = torch.stack([self.scales.t(), zeros.t()], dim=-1).contiguous()  # [K / g, N, 2]
        self.scales_f32, self.minimums_f32 = self.scales.float().contiguous(), self.minimums.float().contiguous()

    def dense(self) -> torch.Tensor:
        """The weights dequantised, [N, K] in the activations' dtype (in float32, rounded once)."""
        if self.nibbles.device.type == "cpu" and cpu_kernels.used():  # one pass over the weights
            return torch.ops.tandem_cpu.dequantize_int4(
                self.nibbles, self.scales, self.minimums, self.group_size, self.scales.dtype
            )
        n, g = self.out_features, self.group_size
        values = torch.stack([self.nibbles & 0xF, self.nibbles >> 4], dim=-1).view(n, -1, g).float()
        w = torch.addcmul(self.minimums.float()[..., None], values, self.scales.float()[..., None])
        return w.view(n, self.in_features).to(self.scales.dtype)

    def native_parts(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """The tensors this layer's product multiplies `x` [rows, in] by where it is a few rows on the
        CPU: `tandem_cpu::skinny_linear_int4`'s nibbles, scales and minimums, or (`skinny` says no)
        torch's packed weights and scales with zeros; then the bias. None elsewhere.
        `tandem_cpu::decode_layers` takes them (the group size is the columns over the scales')."""
        rows = x.shape[0] if x.dim() == 2 else 0
        if not 0 < rows <= INT4_SKINNY_ROWS or self.nibbles.device.type != "cpu":
            return None
        bias = [] if self.bias is None else [self.bias]
        if skinny(x.dtype, bits=4):
            return [self.nibbles, self.scales_f32, self.minimums_f32, *bias]
        return [self.packed, self.scales_and_zeros, *bias]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        rows = flat.shape[0]
        parts = self.native_parts(flat)
        if parts is not None and parts[0] is self.nibbles:
            y = torch.ops.tandem_cpu.skinny_linear_int4(
                flat, self.nibbles, self.scales_f32, self.minimums_f32, self.group_size
            )
        elif rows > INT4_SKINNY_ROWS and prepack.usable(self, flat):
            y = prepack.product(flat, self.prepacked, None)
        elif rows >= self.dense_from_rows:
            y = torch.nn.functional.linear(flat, self.dense())
        else:
            y = torch._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def fitting_group_size(in_features: int, group_size: int) -> int | None:
    """`group_size`, or the largest smaller supported one that divides `in_features` (576 columns,
    SmolLM's width, take groups of 64 when 128 is asked for); None when none does."""
    for g in sorted(GROUP_SIZES, reverse=True):
        if g <= group_size and in_features % g == 0:
            return g
    return None


def _module(linear: nn.Linear, weight_dtype: str, group_size: int, empty: bool) -> nn.Module:
    """The quantised replacement of `linear`, filled or (`empty`) ready for a saved state; int4
    falls back to int8 for a width no group divides."""
    k, n, dtype, bias = linear.in_features, linear.out_features, linear.weight.dtype, linear.bias is not None
    group = fitting_group_size(k, group_size) if weight_dtype == "int4" else None
    if group is None:
        return Int8Linear(k, n, dtype, bias) if empty else Int8Linear.from_linear(linear)
    return Int4Linear(k, n, dtype, bias, group) if empty else Int4Linear.from_linear(linear, group)


def _linears(model: nn.Module, lm_head: bool) -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and (lm_head or f"{parent_name}.{name}".strip(".") != "lm_head"):
                yield parent, name, child


def quantize(model: nn.Module, weight_dtype: str, group_size: int = 128, lm_head: bool = True) -> nn.Module:
    """Swaps `model`'s linear layers for int8 or int4 ones, in place ("auto" leaves it as it is).
    A tied LM head gets its own quantised copy; the embedding table keeps the model's dtype."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, not {weight_dtype!r}")
    if weight_dtype == "auto":
        return model
    if model.embed_tokens.weight.device.type != "cpu":
        raise ValueError("weight-only int8/int4 kernels are wired for the CPU here")
    for parent, name, linear in _linears(model, lm_head):
        setattr(parent, name, _module(linear, weight_dtype, group_size, empty=False))
    model.quantization = {"weight_dtype": weight_dtype, "group_size": group_size, "lm_head": lm_head}
    return model


def quantized_skeleton(model: nn.Module, weight_dtype: str, group_size: int, lm_head: bool | str) -> nn.Module:
    """`model` with empty quantised modules in place of its linear layers, ready for a saved state;
    the LM head quantised as the layers (True), left as it is (False), or (`"int8"`) int8 with a
    scale per block of `Q8_0_BLOCK` columns, as a GGUF file's Q8_0 LM head is kept."""
    if lm_head not in LM_HEADS:
        raise ValueError(f"lm_head must be one of {LM_HEADS}, not {lm_head!r}")
    for parent, name, linear in _linears(model, lm_head is True):
        setattr(parent, name, _module(linear, weight_dtype, group_size, empty=True))
    if lm_head == "int8":
        head = model.lm_head
        model.lm_head = Int8Linear(head.in_features, head.out_features, head.weight.dtype, False, Q8_0_BLOCK)
    model.quantization = {"weight_dtype": weight_dtype, "group_size": group_size, "lm_head": lm_head}
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights a decode step reads: every parameter and saved buffer except the
    embedding table (a step reads only its tokens' rows), counting a tied LM head once."""
    seen, total = set(), 0
    embedding = model.embed_tokens.weight
    tied = model.lm_head.weight is embedding if isinstance(model.lm_head, nn.Linear) else False
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in seen or name == "inv_freq" or (t is embedding and not tied):
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total
