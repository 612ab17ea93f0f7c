"""Prompt products on weights laid out once for AMX tiles (or oneDNN), on CPUs with AMX tiles.

A prompt's chunk multiplies tens to hundreds of rows by every weight matrix: arithmetic, not reading,
bounds it. Eager `F.linear` in bfloat16 runs it through oneDNN, which first copies the whole weight into
the blocked layout its tile kernels read, on every call. Done once at load (`prepack`), the copy is
gone from the pass: SmolLM2-135M's four layer products, bfloat16, 2 threads, on an Intel Xeon with
AMX, 1.2-1.3x faster at 17-256 rows, even (0.92-1.04x) from 512; an int8 or int4 layer's, 1.2-7.6x
(`benchmarks/prefill_products.py`).

Where the kernels run on the tiles (`tandem_cpu::tile_amx`), a bfloat16 weight whose sizes are
multiples of 32 is packed for `tandem_cpu::tile_linear` (`csrc/tile_linear.h`), which streams each
weight tile once for all the rows and asks for the next ones while it multiplies: SmolLM2-135M's 30
layers of products from memory, 2 threads, 1.5x oneDNN's on its packed weights at 16-32 rows,
1.1-1.2x at 128-512, even at 72 (`benchmarks/prefill_products.py`). Other weights are packed for
oneDNN.

The packed weight is a second copy, kept beside the plain one: decode's few-row products
(`tandem_cpu::skinny_linear` and its int8 / int4 twins) stream the plain rows, which they read faster
than a tile kernel does. So `prepack` costs the layers' weights once more in bfloat16 (SmolLM2-135M:
212 MB; the embedding table and the LM head, which a prompt multiplies only at its sampled rows, are
never packed). A quantised layer packs its weights dequantised: its prompt products then run at the
bfloat16 rate, while decode still reads int8 or int4.

`ModelConfig.prepack_weights` chooses: auto packs bfloat16 models on a CPU with AMX tiles, where it
was measured to pay; on packs wherever oneDNN runs the dtype; off never packs.
"""

from __future__ import annotations

import torch
from torch import nn

from cluster.model import cpu_kernels

SETTINGS = ("auto", "on", "off")
TILE_COLUMNS, TILE_DEPTH = 32, 32  # a tile-packed weight's N and K are multiples of these


def wanted(setting: str, dtype: torch.dtype, device: str) -> bool:
    """Whether a model of `dtype` on `device` packs its layers' weights under `setting`."""
    if setting not in SETTINGS:
        raise ValueError(f"prepack_weights must be one of {SETTINGS}, not {setting!r}")
    if setting == "off" or device != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    if setting == "on":
        return dtype in (torch.float32, torch.bfloat16)
    return dtype == torch.bfloat16 and cpu_kernels.amx()


def tiles(weight: torch.Tensor) -> bool:
    """Whether `weight` is packed for the AMX tile kernel rather than for oneDNN."""
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and n % TILE_COLUMNS == 0 and k % TILE_DEPTH == 0 and cpu_kernels.tile_amx()


def pack(weight: torch.Tensor, tiled: bool | None = None) -> torch.Tensor:
    """`weight` [N, K] laid out for `product`: for the tile kernel ([N / 16, K / 32, 16, 32]) or in
    oneDNN's blocked layout (an opaque tensor); `tiled` None chooses by `tiles`."""
    if tiles(weight) if tiled is None else tiled:
        return torch.ops.tandem_cpu.tile_pack(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, K] @ the packed weight's transpose (+ bias): what `F.linear` gives on the plain weight."""
    if packed.dim() == 4:  # tile_pack's layout
        y = torch.ops.tandem_cpu.tile_linear(x, packed)
        return y if bias is None else y + bias
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def usable(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether `module`'s forward takes its packed weight for `x`: packed, eager, in its dtype. A graph
    being compiled never looks at the copy (an opaque tensor; inductor packs weights its own way)."""
    if torch.compiler.is_compiling() or x.requires_grad:
        return False
    return getattr(module, "prepacked", None) is not None and x.dtype == module.prepacked_dtype


def prepack(model: nn.Module) -> int:
    """Packs the weights of every linear layer in `model.layers` (plain or quantised: each has
    `dense()` or a `weight`), once; returns the bytes the copies take."""
    total = 0
    for module in model.layers.modules():
        if not hasattr(module, "prepacked"):
            continue
        weight = module.dense() if hasattr(module, "dense") else module.weight
        module.prepacked, module.prepacked_dtype = pack(weight.detach()), weight.dtype
        total += weight.numel() * weight.element_size()
    return total


def unpack(model: nn.Module) -> None:
    """Drops the packed copies: the layers go back to their own products."""
    for module in model.layers.modules():
        if getattr(module, "prepacked", None) is not None:
            module.prepacked = None
