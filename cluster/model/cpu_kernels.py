"""CPU kernels torch lacks, built from `cluster/model/csrc/` (`cluster.model.kernel_build`).

- `skinny_linear` multiplies a few rows (up to `SKINNY_MAX_ROWS`) by a weight matrix, streaming
  each weight row once for all of them: decode's products, which torch's GEMM kernels run at a
  fraction of the memory bandwidth.
- `skinny_linear_int8` and `_int4` are the same over int8 and 4-bit weights, multiplied in integers
  against the inputs quantised to int8 per block of 32 columns (`csrc/quantized_linear.cpp`), and
  `dequantize_int8` / `_int4` write such weights out dense in one pass, for a prompt's chunk.
- `prefill_attention` is paged attention for prompt chunks: each sequence attends at its own length,
  where one batched call would pad every prompt to the longest; bfloat16 through a flash kernel whose
  products run on AMX tiles, or as AVX512-BF16 pair products, where the CPU has them, other float
  caches (and sliding windows) through a flash kernel in float32 vectors, an int8 cache through
  torch's flash attention. With `torch_flash` (`torch_flash()`: a CPU with AMX tiles the kernels
  cannot use) bfloat16 goes through torch's flash attention too, whose products run on the tiles.
- `tile_pack` and `tile_linear` run a prompt chunk's bfloat16 products on AMX tiles, on weights packed
  once (`csrc/tile_linear.h`, `cluster.model.prepack`); `tile_amx` (`tile_amx()`) says whether the
  kernels run on the tiles here (elsewhere `tile_linear` runs plain loops over the same layout).
  `TANDEM_CPU_TILES=0` keeps them off the tiles (the tests run the other paths on such a CPU so).
- `rms_norm`, `rope` and `silu_mul` are a decoder layer's element-wise steps, one pass each, for
  eager passes (`csrc/elementwise.h`); compiled graphs fuse the same steps themselves.
- `decode_layers` is the decoder layers' whole decode step, eager, as one call into the kernels above
  (`csrc/decode_layer.cpp`): what the layers' modules compute, without their dispatch.
- `race_uniforms` draws the uniforms behind sampling's exponential race (`cluster.engine.sampler`), the
  integers torch's int64 ops made there, in one pass.
- `decode_attention` is paged attention for decode rows: every cached key and value is read once,
  in place, through the block table (torch's paths either gather the cache into a copy first or,
  under `torch.compile`, spend most of their time on per-element index arithmetic).

The sources are compiled with the machine's own C++ compiler through `torch.utils.cpp_extension`,
once per source version and instruction set, by the install step where it can
(`cluster.model.kernel_build`, which says where the builds live). The instruction set is chosen at
run time by the CPU's flags, never by where the kernels were built (`VARIANTS`): AVX-512 with
AVX512-BF16 pair products, AVX-512 without, or AVX2 with FMA and F16C, whose vector paths are eight
lanes wide where AVX-512's are sixteen. `TANDEM_CPU_KERNELS` names one (tests run each path the CPU
can), or `0` for none. Where they cannot be built (no compiler, a CPU with neither) callers keep
torch's paths; the outputs agree to float32 rounding.
"""

from __future__ import annotations

import logging
import threading

import torch

from cluster.model import kernel_build
from cluster.model.kernel_build import VARIANTS as VARIANTS  # the instruction sets, where they are built
from cluster.model.kernel_build import supported as supported
from cluster.model.kernel_build import variant as variant

log = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict[str, bool] = {}  # "loaded": the build's outcome, once tried; "vector": the build has vector paths


def available() -> bool:
    """Builds (first call only) and loads the kernels; False where they cannot be built."""
    if "loaded" in _state:
        return _state["loaded"]
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _load()
    return _state["loaded"]


def used() -> bool:
    """Whether the model routes through the kernels: built with vector paths (AVX2 or AVX-512).
    Their plain loops alone (kept so they build and agree everywhere) are several times slower than
    torch's kernels, so on a CPU with neither the model uses torch's."""
    if "vector" not in _state:
        _state["vector"] = variant() not in (None, "portable")
    return _state["vector"] and available()


def amx() -> bool:
    """Whether the CPU has AMX tiles (`amx_bf16`), on which oneDNN and inductor run products their own way
    (read once; a graph being compiled sees the answer as a constant)."""
    if "amx" not in _state:
        from cluster.cpu import cpu_flags

        _state["amx"] = "amx_bf16" in cpu_flags()
    return _state["amx"]


def tile_amx() -> bool:
    """Whether the kernels run their AMX tile paths here (`tandem_cpu::tile_amx`: built with
    AVX512-BF16, on a CPU with the tiles, granted by Linux, not turned off by `TANDEM_CPU_TILES=0`)."""
    if "tile_amx" not in _state:
        _state["tile_amx"] = used() and bool(torch.ops.tandem_cpu.tile_amx())
    return _state["tile_amx"]


def torch_flash() -> bool:
    """Whether bfloat16 prompt chunks attend through torch's flash attention rather than Tandem's flash
    kernel: on a CPU with AMX tiles that the kernel cannot use, where torch's still runs its products
    on them (2.0-2.4x faster than the kernel's AVX512-BF16 pair products on chunks of 64 tokens or
    more). Where the kernel runs on the tiles it is 1.4-2.2x faster than torch's
    (`benchmarks/prefill_attention.py`)."""
    return amx() and not tile_amx()


def _load() -> bool:
    name = variant()
    if name is None:
        return False
    try:
        torch.ops.load_library(str(kernel_build.built(name)))
    except Exception as e:  # no compiler, no ninja, an unsupported platform: torch's path still works
        log.warning("CPU kernels unavailable, using torch's kernels instead: %s", e)
        return False
    return True


_library = torch.library.Library("tandem_cpu", "DEF")
_library.define(
    "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor mask, float scale)"
    " -> Tensor"
)

_library.define(
    "prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, int[] num_new,"
    " int[] num_cached, float scale, int? window, bool torch_flash=False) -> Tensor"
)
_library.define("skinny_linear(Tensor x, Tensor weight) -> Tensor")
_library.define("skinny_linear_int8(Tensor x, Tensor weight, Tensor scales) -> Tensor")
_library.define(
    "skinny_linear_int4(Tensor x, Tensor nibbles, Tensor scales, Tensor minimums, int group_size) -> Tensor"
)
_library.define("dequantize_int8(Tensor weight, Tensor scales, ScalarType dtype) -> Tensor")
_library.define(
    "dequantize_int4(Tensor nibbles, Tensor scales, Tensor minimums, int group_size, ScalarType dtype) -> Tensor"
)
_library.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_library.define("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor")
_library.define("silu_mul(Tensor gate_up) -> Tensor")
_library.define("tile_pack(Tensor weight) -> Tensor")
_library.define("tile_linear(Tensor x, Tensor packed) -> Tensor")
_library.define("tile_amx() -> bool")
_library.define("race_uniforms(Tensor keys, int vocab) -> Tensor")
_library.define(
    "decode_layers(Tensor x, Tensor[] weights, int[] counts, Tensor cos, Tensor sin, Tensor(a!)[] k_caches,"
    " Tensor(b!)[] v_caches, Tensor slots, Tensor block_tables, Tensor[] masks, int[] mask_of, int heads,"
    " int kv_heads, float scale, float eps) -> Tensor"
)
SKINNY_MAX_ROWS = 64  # the most rows `skinny_linear` takes
# Up to how many rows `skinny_linear` is used. It beats torch's GEMM on the CPUs measured at every
# row count in float32 (`benchmarks/skinny_linear.py`). In bfloat16 it beats `F.linear` at every
# row count too, but compiled decode graphs run torch's products on weights prepacked for oneDNN,
# which overtake it from about 24 rows, where a step is bound by arithmetic rather than by reading
# weights (whole compiled bfloat16 steps of smollm-135m: 16 rows 19.1 against 19.5 ms, 24 rows 25.3
# against 26.0, 32 rows 33.7 against 31.5, 64 rows 67.2 against 61.6).
SKINNY_ROWS = {torch.float32: SKINNY_MAX_ROWS, torch.bfloat16: 16, torch.float16: 16}


@torch.library.register_fake("tandem_cpu::decode_attention")
def _(q, k_cache, v_cache, block_tables, mask, scale):  # type: ignore[no-untyped-def]
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@torch.library.register_fake("tandem_cpu::prefill_attention")
def _(q, k_cache, v_cache, block_tables, num_new, num_cached, scale, window, torch_flash=False):  # type: ignore[no-untyped-def]
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@torch.library.register_fake("tandem_cpu::skinny_linear")
def _(x, weight):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.register_fake("tandem_cpu::skinny_linear_int8")
def _(x, weight, scales):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.register_fake("tandem_cpu::skinny_linear_int4")
def _(x, nibbles, scales, minimums, group_size):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape[0], nibbles.shape[0])


@torch.library.register_fake("tandem_cpu::tile_linear")
def _(x, packed):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape[0], packed.shape[0] * packed.shape[3] // 2)


@torch.library.register_fake("tandem_cpu::dequantize_int8")
def _(weight, scales, dtype):  # type: ignore[no-untyped-def]
    return weight.new_empty(weight.shape, dtype=dtype)


@torch.library.register_fake("tandem_cpu::dequantize_int4")
def _(nibbles, scales, minimums, group_size, dtype):  # type: ignore[no-untyped-def]
    return nibbles.new_empty(nibbles.shape[0], 2 * nibbles.shape[1], dtype=dtype)
