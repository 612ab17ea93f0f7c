"""The CPU kernels (`cluster/model/cpu_kernels.py`) against torch's own paths on the same inputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cluster.model import cpu_kernels, quant
from cluster.model.attention import (
    SeqChunk,
    _attend_padded,
    _write_kv,
    build_attention_metadata,
    dequantize_rows,
    paged_attention,
    quantize_rows,
)
from cluster.model.causal_lm import Linear
from cluster.model.cpu_kernels import SKINNY_MAX_ROWS, SKINNY_ROWS
from cluster.model.quant import INT8_SKINNY_ROWS, Int4Linear, Int8Linear, quantize_int4, quantize_int8

BLOCK = 8
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler to build the CPU kernels")


@pytest.fixture(autouse=True)
def kernels_in_use(monkeypatch):
    """The model routes through the kernels here whatever they were built for (with neither AVX2 nor
    AVX-512 it uses torch's faster kernels), so their plain-loop paths are checked too."""
    monkeypatch.setitem(cpu_kernels._state, "vector", True)


def test_the_model_uses_the_kernels_only_where_they_have_vector_paths(monkeypatch):
    monkeypatch.setitem(cpu_kernels._state, "vector", False)
    assert cpu_kernels.available() and not cpu_kernels.used()
    monkeypatch.setitem(cpu_kernels._state, "vector", True)
    assert cpu_kernels.used()
    monkeypatch.setitem(cpu_kernels._state, "loaded", False)
    assert not cpu_kernels.used(), "never when they are not built"


def _case(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    """A paged cache with scattered blocks and three decode rows of different lengths, their new
    keys and values already written."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(14, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(14, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    chunks = [SeqChunk([3, 7, 1], 17, 1), SeqChunk([0], 2, 1), SeqChunk([5, 2, 9, 11, 13], 37, 1)]
    meta = build_attention_metadata(chunks, BLOCK, frozenset({None, 5}))
    q = torch.randn(3, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(3, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(3, kv_heads, head_dim, generator=gen).to(dtype)
    _write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return q, k_cache, v_cache, meta


def _sdpa(q, k_cache, v_cache, meta, window, scale):  # type: ignore[no-untyped-def]
    (g,) = meta.groups
    return _attend_padded(q, k_cache, v_cache, g.block_tables, g.query_index, g.masks[window], 1, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (14, 2, 64), (4, 4, 16), (8, 2, 128), (4, 2, 256), (6, 2, 24)]
)
@pytest.mark.parametrize("window", [None, 5])
def test_decode_attention_equals_sdpa(dtype, heads, kv_heads, head_dim, window):
    """Vector paths (head_dim a multiple of 16; 64, 128 and 256 sum values in registers, a KV head's
    query heads a few at a time: 7 query heads a KV head take two passes) and the scalar path (24),
    grouped and plain heads, with and without a sliding window."""
    q, k_cache, v_cache, meta = _case(dtype, heads, kv_heads, head_dim)
    (g,) = meta.groups
    got = torch.ops.tandem_cpu.decode_attention(q, k_cache, v_cache, g.block_tables, g.masks[window], 0.3)
    expected = _sdpa(q.float(), k_cache.float(), v_cache.float(), meta, window, 0.3)
    assert got.dtype == dtype and got.shape == expected.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 4])
def test_decode_attention_split_over_threads_equals_sdpa(dtype, threads):
    """A long context on more threads than rows is split into parts (each part's maximum, sum of
    exponentials and output, merged at the end); on one thread it is one part. Both equal SDPA,
    whatever thread count the run itself has."""
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(48, BLOCK, 2, 64, generator=gen).to(dtype)
    v_cache = torch.randn(48, BLOCK, 2, 64, generator=gen).to(dtype)
    blocks = torch.randperm(48, generator=gen)[:40].tolist()
    meta = build_attention_metadata([SeqChunk(blocks, 40 * BLOCK - 3, 1)], BLOCK, frozenset({None}))
    q = torch.randn(1, 8, 64, generator=gen).to(dtype)
    (g,) = meta.groups
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = torch.ops.tandem_cpu.decode_attention(q, k_cache, v_cache, g.block_tables, g.masks[None], 0.125)
    finally:
        torch.set_num_threads(before)
    expected = _sdpa(q.float(), k_cache.float(), v_cache.float(), meta, None, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_int8_rows_with_their_scales(dtype):
    q, k_cache, v_cache, meta = _case(dtype, 9, 3, 64)
    k_rows, v_rows = quantize_rows(k_cache), quantize_rows(v_cache)
    (g,) = meta.groups
    got = torch.ops.tandem_cpu.decode_attention(q, k_rows, v_rows, g.block_tables, g.masks[None], 0.125)
    expected = _sdpa(q.float(), dequantize_rows(k_rows, torch.float32), dequantize_rows(v_rows, torch.float32),
                     meta, None, 0.125)  # fmt: skip
    torch.testing.assert_close(got.float(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (6, 2, 24)])
def test_decode_attention_reads_a_16_bit_cache_under_float32_queries(cache_dtype, heads, kv_heads, head_dim):
    """`kv_dtype: float16` / `bfloat16` under a float32 model: the rows are widened as they are read and
    the output is float32, float32 attention over the same rounded rows (AVX512-BF16's pair products
    round the queries of a bfloat16 cache too)."""
    q, k_cache, v_cache, meta = _case(torch.float32, heads, kv_heads, head_dim)
    k16, v16 = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    (g,) = meta.groups
    got = torch.ops.tandem_cpu.decode_attention(q, k16, v16, g.block_tables, g.masks[None], 0.3)
    expected = _sdpa(q, k16.float(), v16.float(), meta, None, 0.3)
    assert got.dtype == torch.float32
    tol = 1e-5 if cache_dtype == torch.float16 else 1e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    with pytest.raises(RuntimeError, match="must hold q's dtype"):
        torch.ops.tandem_cpu.decode_attention(q.bfloat16(), k16.half(), v16.half(), g.block_tables, g.masks[None], 0.3)


def test_paged_attention_uses_the_kernel_for_decode_rows_and_matches_torch_without_it(monkeypatch):
    q, k_cache, v_cache, meta = _case(torch.float32, 9, 3, 64)
    k, v = torch.zeros(3, 3, 64), torch.zeros(3, 3, 64)
    slots = meta.slot_mapping
    k.copy_(k_cache.view(-1, 3, 64)[slots]), v.copy_(v_cache.view(-1, 3, 64)[slots])
    with_kernel = paged_attention(q, k, v, (k_cache, v_cache), meta, 0.125)
    monkeypatch.setitem(cpu_kernels._state, "loaded", False)
    without = paged_attention(q, k, v, (k_cache, v_cache), meta, 0.125)
    torch.testing.assert_close(with_kernel, without, rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_with_a_clear_error():
    q, k_cache, v_cache, meta = _case(torch.float32, 9, 3, 64)
    (g,) = meta.groups
    with pytest.raises(RuntimeError, match="outside the cache's 14 blocks"):
        torch.ops.tandem_cpu.decode_attention(q, k_cache, v_cache, g.block_tables + 20, g.masks[None], 0.1)
    with pytest.raises(RuntimeError, match="must hold q's dtype"):
        torch.ops.tandem_cpu.decode_attention(q.bfloat16(), k_cache, v_cache, g.block_tables, g.masks[None], 0.1)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        torch.ops.tandem_cpu.decode_attention(q[:, :8], k_cache, v_cache, g.block_tables, g.masks[None], 0.1)


# -- prefill_attention: prompt chunks, each at its own length ---------------------------------------


def _prefill_case(
    dtype: torch.dtype, chunks: list[SeqChunk], heads: int = 9, kv_heads: int = 3, dim: int = 64, blocks: int = 20
):
    """A scattered paged cache holding every position the chunks reach, and the chunks' queries."""
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(sum(c.num_new for c in chunks), heads, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, build_attention_metadata(chunks, BLOCK, frozenset({None, 6, 40}))


def _prefill(q, k_cache, v_cache, meta, window, scale=0.2, torch_flash=False):  # type: ignore[no-untyped-def]
    (g,) = meta.groups
    got = torch.ops.tandem_cpu.prefill_attention(
        q, k_cache, v_cache, g.block_tables, g.num_new, g.num_cached, scale, window, torch_flash
    )
    expected = _attend_padded(q.float(), k_cache.float() if k_cache.dtype != torch.uint8 else
                              dequantize_rows(k_cache, torch.float32), v_cache.float() if v_cache.dtype != torch.uint8
                              else dequantize_rows(v_cache, torch.float32), g.block_tables, g.query_index,
                              g.masks[window], g.max_new, scale)  # fmt: skip
    return got, expected


WHOLE_PROMPTS = [SeqChunk([4, 9, 1], 0, 21), SeqChunk([7], 0, 3), SeqChunk([2, 12, 0, 16, 5], 0, 37)]
LATER_CHUNKS = [SeqChunk([4, 9, 1], 13, 8), SeqChunk([7], 0, 5), SeqChunk([2, 12, 0, 16, 5], 30, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunks", [WHOLE_PROMPTS, LATER_CHUNKS], ids=["whole prompts", "later chunks"])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("torch_flash", [False, True], ids=["ours", "torch flash"])
def test_prefill_attention_equals_padded_sdpa(dtype, chunks, window, torch_flash):
    """Prompts of different lengths (the padded path pads them to the longest), chunks that start
    after cached positions, with and without a sliding window, grouped query heads; bfloat16 through
    this CPU's kernel and through torch's flash attention (what a CPU with AMX tiles takes)."""
    got, expected = _prefill(*_prefill_case(dtype, chunks), window, torch_flash=torch_flash)
    assert got.dtype == dtype and got.shape == expected.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


# Longer than one key block (64 for the AVX512-BF16 kernel, 32 or 64 for the float32-vector one) and
# one query block (32); one chunk starts mid-block after cached positions, another ends one past a block.
LONG_CHUNKS = [SeqChunk(list(range(40, 0, -1)), 70, 250), SeqChunk(list(range(41, 50)), 0, 65)]


# torch_flash changes the path of bfloat16 only.
DTYPE_PATHS = [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False)]


@pytest.mark.parametrize(("dtype", "torch_flash"), DTYPE_PATHS, ids=["f32", "bf16", "bf16 torch flash", "f16"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
@pytest.mark.parametrize("window", [None, 40])
def test_prefill_attention_long_chunks(dtype, torch_flash, heads, kv_heads, dim, window):
    """The flash kernels' blocks of queries and keys (bfloat16 through AVX512-BF16 pair products
    where the CPU has them and no window is set, every float dtype through float32 vectors), several
    query heads per KV head or one, head dims of one and two strips, a sliding window longer than a
    key block (whole blocks before it are skipped), against float32 attention on the same inputs;
    bfloat16 with `torch_flash` through torch's flash attention."""
    q, k_cache, v_cache, meta = _prefill_case(dtype, LONG_CHUNKS, heads, kv_heads, dim, blocks=50)
    got, expected = _prefill(q, k_cache, v_cache, meta, window, torch_flash=torch_flash)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)
    assert (got.float() - expected).abs().mean() < tol / 10  # rounding, not a wrong weight here and there


@pytest.mark.parametrize(
    ("flags", "tiles", "torch_flash"),
    [
        ({"avx512_bf16"}, False, False),
        ({"avx512_bf16", "amx_bf16"}, True, False),
        ({"avx512_bf16", "amx_bf16"}, False, True),
    ],
    ids=["no tiles", "tiles the kernel runs on", "tiles only torch runs on"],
)
def test_prompt_chunks_take_torch_flash_attention_only_where_the_kernel_cannot_use_the_amx_tiles(
    monkeypatch, flags, tiles, torch_flash
):
    import cluster.cpu

    monkeypatch.setattr(cluster.cpu, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.delitem(cpu_kernels._state, "amx", raising=False)
    monkeypatch.setattr(cpu_kernels, "tile_amx", lambda: tiles)
    assert cpu_kernels.torch_flash() is torch_flash


def test_prefill_attention_reads_int8_rows_with_their_scales():
    q, k_cache, v_cache, meta = _prefill_case(torch.float32, LATER_CHUNKS)
    got, expected = _prefill(q, quantize_rows(k_cache), quantize_rows(v_cache), meta, None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
def test_prefill_attention_reads_a_16_bit_cache_under_float32_queries(cache_dtype, window):
    q, k_cache, v_cache, meta = _prefill_case(torch.float32, LATER_CHUNKS)
    got, expected = _prefill(q, k_cache.to(cache_dtype), v_cache.to(cache_dtype), meta, window)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_16_bit_cache_under_float32_rows_is_written_rounded_and_read_alike_with_and_without_kernels(monkeypatch):
    """A pass of decode rows and prompt chunks writes its float32 keys and values rounded into a
    float16 cache and attends over it: the same outputs with and without the kernels."""
    chunks = [SeqChunk([4, 9, 1], 13, 8), SeqChunk([3], 5, 1), SeqChunk([7], 0, 5)]
    q, k_cache, v_cache, meta = _prefill_case(torch.float32, chunks)
    k = torch.randn(q.shape[0], 3, 64)
    kv = (k_cache.half(), v_cache.half())
    with_kernel = paged_attention(q, k, k, kv, meta, 0.125)
    assert torch.equal(kv[0].view(-1, 3, 64)[meta.slot_mapping], k.half())
    monkeypatch.setitem(cpu_kernels._state, "loaded", False)
    without = paged_attention(q, k, k, (k_cache.half(), v_cache.half()), meta, 0.125)
    assert with_kernel.dtype == without.dtype == torch.float32
    torch.testing.assert_close(with_kernel, without, rtol=1e-5, atol=1e-5)


def test_paged_attention_uses_the_prefill_kernel_and_matches_torch_without_it(monkeypatch):
    """A pass of decode rows and prompt chunks together: the same outputs with and without kernels."""
    chunks = [SeqChunk([4, 9, 1], 13, 8), SeqChunk([3], 5, 1), SeqChunk([7], 0, 5)]
    q, k_cache, v_cache, meta = _prefill_case(torch.float32, chunks)
    k = torch.randn(q.shape[0], 3, 64)
    with_kernel = paged_attention(q, k, k, (k_cache.clone(), v_cache.clone()), meta, 0.125)
    monkeypatch.setitem(cpu_kernels._state, "loaded", False)
    without = paged_attention(q, k, k, (k_cache, v_cache), meta, 0.125)
    torch.testing.assert_close(with_kernel, without, rtol=1e-5, atol=1e-5)


def test_prefill_attention_refuses_bad_input():
    q, k_cache, v_cache, meta = _prefill_case(torch.float32, WHOLE_PROMPTS)
    (g,) = meta.groups
    call = torch.ops.tandem_cpu.prefill_attention
    with pytest.raises(RuntimeError, match="outside the cache's 20 blocks"):
        call(q, k_cache, v_cache, g.block_tables + 20, g.num_new, g.num_cached, 0.1, None)
    with pytest.raises(RuntimeError, match="adds up to 61 tokens, q has 62"):
        call(torch.cat([q, q[:1]]), k_cache, v_cache, g.block_tables, g.num_new, g.num_cached, 0.1, None)
    with pytest.raises(RuntimeError, match="block table is too short"):
        call(q, k_cache, v_cache, g.block_tables[:, :2], g.num_new, g.num_cached, 0.1, None)
    with pytest.raises(RuntimeError, match="must hold q's dtype"):
        call(q.bfloat16(), k_cache, v_cache, g.block_tables, g.num_new, g.num_cached, 0.1, None)
    with pytest.raises(RuntimeError, match="one entry per sequence"):
        call(q, k_cache, v_cache, g.block_tables, g.num_new[:2], g.num_cached, 0.1, None)


# -- skinny_linear: products of a few rows -------------------------------------------------------


def _weights(n: int, k: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SKINNY_MAX_ROWS, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(40, 96), (300, 576), (7, 40)])
def test_skinny_linear_equals_f_linear(dtype, n, k):
    """Every row count of one group of eight, several groups (and a part of one), vector widths (96,
    576: the bfloat16 pair path too) and a scalar one (40), weights split across threads and tiles
    (300 rows) and too small to split."""
    x, w = _weights(n, k, dtype)
    for rows in [*range(1, 9), 12, 17, SKINNY_MAX_ROWS]:
        got = torch.ops.tandem_cpu.skinny_linear(x[:rows], w)
        expected = F.linear(x[:rows].float(), w.float())
        assert got.dtype == dtype and got.shape == (rows, n)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol * k**0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_linear_row_results_do_not_depend_on_their_company(dtype):
    """A row's product is bit for bit the same alone or beside any others: a token verified in a
    draft scores exactly as it would decoding alone."""
    x, w = _weights(300, 576, dtype)
    together = torch.ops.tandem_cpu.skinny_linear(x, w)
    for i in range(0, SKINNY_MAX_ROWS, 7):
        assert torch.equal(torch.ops.tandem_cpu.skinny_linear(x[i : i + 1], w)[0], together[i])


def test_skinny_linear_refuses_what_it_cannot_do():
    x, w = _weights(40, 96, torch.float32)
    with pytest.raises(RuntimeError, match=f"at most {SKINNY_MAX_ROWS} rows"):
        torch.ops.tandem_cpu.skinny_linear(torch.cat([x, x[:1]]), w)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.tandem_cpu.skinny_linear(x.bfloat16(), w)
    with pytest.raises(RuntimeError, match=r"x \[rows, k\] and weight \[n, k\]"):
        torch.ops.tandem_cpu.skinny_linear(x[:, :95], w)


def _inputs_as_quantised(x: torch.Tensor) -> torch.Tensor:
    """x as the quantised products see it: each block of 32 columns of a row in int8 with its own
    scale, max |x| / 127 (float64, so a reference built on it rounds no further)."""
    x = x.double()
    out = torch.empty_like(x)
    for c in range(0, x.shape[1], 32):
        block = x[:, c : c + 32]
        scale = block.abs().amax(dim=1, keepdim=True) / 127
        out[:, c : c + 32] = torch.round(block / scale.clamp(min=1e-300)) * scale
    return out


def _assert_quantised_product(got, x, dense, exact, tol):
    """`got` equals the product of `x` as quantised with `dense` (float64) to float32 rounding (`tol`:
    the output dtype's), and is within 3 % of the largest output of the product without quantised
    inputs (`exact`): what quantising the inputs costs."""
    expected = F.linear(_inputs_as_quantised(x.float()), dense.double()).float()
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol * x.shape[1] ** 0.5)
    assert (got.float() - exact).abs().max() <= 0.03 * exact.abs().max(), (got.float() - exact).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(40, 96), (300, 576), (30, 128), (7, 40), (64, 1000)])
def test_skinny_linear_int8_equals_the_product_with_quantised_inputs(dtype, n, k):
    """int8 weights with a scale per row against inputs quantised per block of 32 columns, in integer
    dot products: every row count of a group, several groups, vector widths and a last vector part
    full (k = 40, 1000), one row against weight rows four at a time and those left over (k = 128,
    576), weights split across threads and tiles; the output in the activations' dtype."""
    x, w = _weights(n, k, torch.float32)
    q, scales = quantize_int8(w)
    for rows in [*range(1, 9), 12, 17, SKINNY_MAX_ROWS]:
        xs = x[:rows].to(dtype)
        got = torch.ops.tandem_cpu.skinny_linear_int8(xs, q, scales.to(dtype))
        dense = q.float() * scales.to(dtype).float()[:, None]
        assert got.dtype == dtype and got.shape == (rows, n)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        _assert_quantised_product(got, xs.float(), dense, F.linear(xs.float(), dense), tol)
    with pytest.raises(RuntimeError, match="int8 weights"):
        torch.ops.tandem_cpu.skinny_linear_int8(x, w, scales)
    with pytest.raises(RuntimeError, match=r"a scale per weight row \[n\]"):
        torch.ops.tandem_cpu.skinny_linear_int8(x, q, scales[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(40, 96), (300, 576), (30, 128), (7, 32)])
def test_skinny_linear_int8_with_a_scale_per_block_of_32(dtype, n, k):
    """GGUF's Q8_0 kept as it is: int8 weights with a scale per block of 32 columns of each row
    (k = 96: a last vector with one block), equal to the dequantised weights' product with the
    inputs as quantised; `Int8Linear` with `block_size` runs it, and its many-row products the
    dense one on the same weights."""
    x, w = _weights(n, k, torch.float32)
    layer = Int8Linear(k, n, dtype, bias=False, block_size=32)
    blocks = w.view(n, k // 32, 32)
    scales = (blocks.abs().amax(-1) / 127).clamp(min=1e-12)
    layer.weight.copy_(torch.round(blocks / scales[..., None]).to(torch.int8).view(n, k))
    layer.scales.copy_(scales)
    dense = layer.dense().float()
    for rows in [*range(1, 9), 17, SKINNY_MAX_ROWS]:
        xs = x[:rows].to(dtype)
        got = torch.ops.tandem_cpu.skinny_linear_int8(xs, layer.weight, layer.scales)
        assert got.dtype == dtype and got.shape == (rows, n)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        _assert_quantised_product(got, xs.float(), dense, F.linear(xs.float(), dense), tol)
    with torch.inference_mode():
        assert torch.equal(
            layer(x[:3].to(dtype)), torch.ops.tandem_cpu.skinny_linear_int8(x[:3].to(dtype), layer.weight, layer.scales)
        )
        torch.testing.assert_close(
            layer(x.to(dtype)).float(), F.linear(x.to(dtype).float(), dense), rtol=tol, atol=tol * k**0.5
        )
    with pytest.raises(RuntimeError, match="per block of 32 columns"):
        torch.ops.tandem_cpu.skinny_linear_int8(x[:1], layer.weight, layer.scales[:, 1:])
    with pytest.raises(ValueError, match="int8 blocks take 32 columns"):
        Int8Linear(40, 8, dtype, bias=False, block_size=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("n", "k", "group"), [(48, 96, 32), (144, 576, 32), (304, 576, 64), (16, 256, 128), (32, 1536, 256)]
)
def test_skinny_linear_int4_equals_the_product_with_quantised_inputs(dtype, n, k, group):
    """4-bit weights two to a byte with a scale and a minimum per group, against inputs quantised
    per block of 32 columns (the minimums' part too): every row count of a
    group of rows, several groups, each group size, a last vector part full (k = 96, 576), one row
    against weight rows four at a time and those a tile leaves over (k = 576: tiles of 113 rows),
    weights split across threads and tiles; bfloat16 scales and minimums give what their float32
    copies give."""
    x, w = _weights(n, k, torch.float32)
    layer = Int4Linear.from_linear(nn.Linear(k, n, bias=False).to(dtype), group)
    q, scales, low = quantize_int4(w, group)
    layer.nibbles.copy_(q[:, 0::2] | (q[:, 1::2] << 4))
    layer.scales.copy_(scales)
    layer.minimums.copy_(low)
    layer.pack()
    dense = layer.dense().float()
    steps = (layer.dense().float() - layer.minimums.float().repeat_interleave(group, 1)).double()
    for rows in [*range(1, 9), 12, 17, SKINNY_MAX_ROWS]:
        xs = x[:rows].to(dtype)
        got = torch.ops.tandem_cpu.skinny_linear_int4(xs, layer.nibbles, layer.scales_f32, layer.minimums_f32, group)
        assert got.dtype == dtype and got.shape == (rows, n)
        if dtype == torch.bfloat16:  # the scales as the layer stores them, widened by the op
            as_stored = torch.ops.tandem_cpu.skinny_linear_int4(xs, layer.nibbles, layer.scales, layer.minimums, group)
            torch.testing.assert_close(as_stored.float(), got.float(), rtol=2**-7, atol=1e-5)
        sums = _inputs_as_quantised(xs.float()).view(rows, k // group, group).sum(-1)
        minimums = (sums @ layer.minimums.double().t()).float()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        exact = F.linear(xs.float(), dense) - minimums
        _assert_quantised_product(got.float() - minimums, xs.float(), steps, exact, tol)
    with pytest.raises(RuntimeError, match="the group size must be a multiple of 32 dividing k"):
        torch.ops.tandem_cpu.skinny_linear_int4(x[:1], layer.nibbles, layer.scales_f32, layer.minimums_f32, 40)
    with pytest.raises(RuntimeError, match=r"scales and minimums \[n, k / group_size\]"):
        torch.ops.tandem_cpu.skinny_linear_int4(
            x[:1], layer.nibbles, layer.scales_f32[:, 1:], layer.minimums_f32, group
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantised_layers_use_the_kernels_eager_and_in_float32_graphs(dtype):
    """`Int8Linear`'s and `Int4Linear`'s few-row products, eager and compiled, equal the product of
    their inputs as the kernels quantise them where the kernels run, else the dequantised product;
    the kernels run them except bfloat16 int4 products, and compiled bfloat16 graphs on a CPU
    without AMX tiles, which keep torch's and inductor's products."""
    gen = torch.Generator().manual_seed(3)
    assert quant.skinny(dtype) == cpu_kernels.used(), "eager, the int8 kernel runs wherever the kernels do"
    assert quant.skinny(dtype, bits=4) == (cpu_kernels.used() and dtype == torch.float32)
    linear = nn.Linear(96, 48, bias=True).to(dtype)
    for layer in (Int8Linear.from_linear(linear), Int4Linear.from_linear(linear, 32)):
        compiled = torch.compile(layer, fullgraph=True, dynamic=False)
        bits = 8 if isinstance(layer, Int8Linear) else 4
        for rows in (1, 3, INT8_SKINNY_ROWS + 1):
            x = torch.randn(rows, 96, generator=gen).to(dtype)
            with torch.inference_mode():
                for got, graph in ((layer(x), False), (compiled(x), True)):
                    bf16 = dtype != torch.float32
                    ours = not bf16 or (bits == 8 and (not graph or cpu_kernels.amx()))
                    kernel = rows <= INT8_SKINNY_ROWS and cpu_kernels.used() and ours
                    tol = 1e-5 if dtype == torch.float32 else 2e-2
                    torch.testing.assert_close(got.float(), _reference(layer, x, kernel), rtol=tol, atol=tol * 10)
        torch._dynamo.reset()


def _reference(layer: nn.Module, x: torch.Tensor, quantised_inputs: bool) -> torch.Tensor:
    """A quantised layer's output on `x`: with `quantised_inputs`, on x as the kernels quantise it."""
    dense, bias = layer.dense().float(), layer.bias.float()
    if not quantised_inputs:
        return F.linear(x.float(), dense, bias)
    xq = _inputs_as_quantised(x.float())
    if isinstance(layer, Int8Linear):
        return (F.linear(xq, dense.double()) + bias).float()
    g = layer.group_size
    minimums = layer.minimums.double()
    steps = dense.double() - minimums.repeat_interleave(g, 1)
    sums = xq.view(x.shape[0], -1, g).sum(-1)
    return (F.linear(xq, steps) + sums @ minimums.t() + bias).float()


def _layer(dtype: torch.dtype) -> Linear:
    gen = torch.Generator().manual_seed(1)
    layer = Linear(96, 40, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=gen))
        layer.bias.copy_(torch.randn(40, generator=gen))
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", [True, False], ids=["skinny-kernel", "no-kernels"])
def test_linear_few_row_products_equal_f_linear(dtype, kernels, monkeypatch):
    """`Linear`, eager and compiled, from one row to past the rows the kernel is used for; without
    the kernels, compiled one- and two-row products are reductions and the rest stay GEMMs."""
    if not kernels:
        monkeypatch.setitem(cpu_kernels._state, "loaded", False)
        torch._dynamo.reset()  # graphs traced with the kernels available took that as a constant
    layer = _layer(dtype)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    gen = torch.Generator().manual_seed(2)
    used = SKINNY_ROWS[dtype]
    for rows in sorted({1, 2, 3, used, used + 1}):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        with torch.inference_mode():
            expected = F.linear(x, layer.weight, layer.bias)
            for got in (layer(x), compiled(x)):
                assert got.dtype == dtype and got.shape == (rows, 40)
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol * 10)
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_writes_the_weights_torch_expressions_write(dtype):
    """`dequantize_int8` (a scale per row, or per block of 32) and `dequantize_int4` (each group size)
    write what the layers' torch expressions do (int8 exactly; int4 to one rounding, where one side
    fuses its multiply-add): float32 arithmetic rounded once to the dtype; the layers' `dense` uses
    them."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(48, 256, generator=gen)
    q, scales = quantize_int8(w)
    scales = scales.to(dtype)
    expected = (q.float() * scales.float()[:, None]).to(dtype)
    assert torch.equal(torch.ops.tandem_cpu.dequantize_int8(q, scales, dtype), expected)
    blocks = torch.rand(48, 256 // 32, generator=gen).to(dtype)
    expected = (q.view(48, -1, 32).float() * blocks.float()[..., None]).view(48, 256).to(dtype)
    assert torch.equal(torch.ops.tandem_cpu.dequantize_int8(q, blocks, dtype), expected)
    for group in (32, 64, 128, 256):
        values, group_scales, low = quantize_int4(w, group)
        nibbles = values[:, 0::2] | (values[:, 1::2] << 4)
        group_scales, low = group_scales.to(dtype), low.to(dtype)
        spread = [t.float().repeat_interleave(group, 1) for t in (low, group_scales)]
        expected = torch.addcmul(spread[0], values.float(), spread[1]).to(dtype)
        got = torch.ops.tandem_cpu.dequantize_int4(nibbles, group_scales, low, group, dtype)
        # minimum + value * scale: fused or not, as the compiler and torch's build choose (one ulp)
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got, expected, rtol=eps, atol=eps * expected.abs().max().item())
    layer = Int8Linear.from_linear(nn.Linear(256, 48).to(dtype))
    assert torch.equal(layer.dense(), (layer.weight.float() * layer.scales.float()[:, None]).to(dtype))
    with pytest.raises(RuntimeError, match="per block of 32 columns"):
        torch.ops.tandem_cpu.dequantize_int8(q, blocks[:, 1:], dtype)
    with pytest.raises(RuntimeError, match=r"scales and minimums \[n, k / group_size\]"):
        torch.ops.tandem_cpu.dequantize_int4(nibbles, group_scales, low, 32, dtype)


@pytest.mark.parametrize(("flags", "amx"), [({"avx512_bf16"}, False), ({"avx512_bf16", "amx_bf16"}, True)])
def test_compiled_bfloat16_int8_graphs_take_the_kernel_where_the_cpu_has_amx_tiles(monkeypatch, flags, amx):
    import cluster.cpu

    monkeypatch.setattr(cluster.cpu, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.delitem(cpu_kernels._state, "amx", raising=False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert quant.skinny(torch.bfloat16) is (amx and cpu_kernels.used())
    assert quant.skinny(torch.bfloat16, bits=4) is False
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)  # eager: int8 ours wherever the kernels run
    assert quant.skinny(torch.bfloat16) is cpu_kernels.used()


def _rms_norm_torch(x, weight, eps):  # type: ignore[no-untyped-def]
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, dim", [(1, 576), (5, 72), (72, 576), (3, 7)])
def test_elementwise_steps_equal_torchs_ops(dtype, rows, dim):
    """RMSNorm, silu(gate) * up and the rotary embedding in one pass each give what torch's ops give,
    rounded where they round: the rotary embedding exactly in 16-bit dtypes (products and a sum, each
    rounded), the others to the dtype's last bit (sums and exp in another order)."""
    gen = torch.Generator().manual_seed(rows * dim)
    x, weight = torch.randn(rows, dim, generator=gen).to(dtype), torch.randn(dim, generator=gen).to(dtype)
    torch.testing.assert_close(torch.ops.tandem_cpu.rms_norm(x, weight, 1e-5), _rms_norm_torch(x, weight, 1e-5))
    gate_up = (4 * torch.randn(rows, 2 * dim, generator=gen)).to(dtype)
    gate, up = gate_up.split(dim, dim=-1)
    torch.testing.assert_close(torch.ops.tandem_cpu.silu_mul(gate_up), F.silu(gate) * up)
    heads, head_dim = 3, 2 * (dim // 6) or 2
    fused = torch.randn(rows, (heads + 2) * head_dim, generator=gen).to(dtype)
    q = fused[:, : heads * head_dim].view(rows, heads, head_dim)  # a view of a fused projection's columns
    cos, sin = (torch.randn(rows, 1, head_dim, generator=gen).to(dtype) for _ in range(2))
    want = q * cos + q.roll(head_dim // 2, dims=-1) * sin
    got = torch.ops.tandem_cpu.rope(q, cos, sin)
    assert got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want)
    else:
        assert torch.equal(got, want)


def test_the_model_takes_the_elementwise_steps_eagerly_and_agrees_without_them(monkeypatch):
    """An eager bfloat16 layer's RMSNorm, rotary embedding and MLP call the kernels' steps, once each,
    and give what torch's ops give; without the kernels they call none."""
    from types import SimpleNamespace

    from cluster.model import causal_lm

    torch.manual_seed(0)
    norm, mlp = (
        causal_lm.RMSNorm(64, 1e-6),
        causal_lm.MLP(SimpleNamespace(hidden_size=64, intermediate_size=96, mlp_bias=False)),
    )
    nn.init.normal_(norm.weight)
    norm, mlp = norm.to(torch.bfloat16), mlp.to(torch.bfloat16)
    x, q = torch.randn(9, 64, dtype=torch.bfloat16), torch.randn(9, 4, 16, dtype=torch.bfloat16)
    cos, sin = torch.randn(9, 1, 16, dtype=torch.bfloat16), torch.randn(9, 1, 16, dtype=torch.bfloat16)
    calls: list[str] = []
    for name in ("rms_norm", "rope", "silu_mul"):
        real = getattr(torch.ops.tandem_cpu, name)
        monkeypatch.setattr(torch.ops.tandem_cpu, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))

    def layer():  # type: ignore[no-untyped-def]
        with torch.inference_mode():
            return norm(x), causal_lm.apply_rope(q, cos, sin), mlp(x)

    fused = layer()
    assert sorted(calls) == ["rms_norm", "rope", "silu_mul"]
    monkeypatch.setitem(cpu_kernels._state, "vector", False)
    calls.clear()
    for got, want in zip(fused, layer(), strict=True):
        torch.testing.assert_close(got, want)
    assert not calls


def test_elementwise_steps_refuse_bad_input():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight and x differ in dtype"):
        torch.ops.tandem_cpu.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="gate_up \\[rows, 2 \\* width\\]"):
        torch.ops.tandem_cpu.silu_mul(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="rope: cos and sin"):
        torch.ops.tandem_cpu.rope(torch.randn(4, 2, 8), torch.randn(4, 1, 6), torch.randn(4, 1, 6))
    with pytest.raises(RuntimeError, match="takes float32, bfloat16 or float16"):
        torch.ops.tandem_cpu.silu_mul(torch.ones(4, 8, dtype=torch.int32))


def test_tile_pack_lays_each_tile_out_as_the_tiles_read_it():
    """Tile (j, b), row r: input columns 32b + 2r and 32b + 2r + 1 of weight rows 16j to 16j + 15,
    pair after pair."""
    w = torch.arange(64 * 96, dtype=torch.float32).view(64, 96).bfloat16()  # every value exact
    packed = torch.ops.tandem_cpu.tile_pack(w)
    assert packed.shape == (4, 3, 16, 32)
    for j, b, r, c, e in [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (1, 2, 15, 7, 1), (3, 1, 4, 15, 0)]:
        assert packed[j, b, r, 2 * c + e] == w[16 * j + c, 32 * b + 2 * r + e]
    torch.testing.assert_close(packed, w.view(4, 16, 3, 16, 2).permute(0, 2, 3, 1, 4).reshape(4, 3, 16, 32))


@pytest.mark.parametrize("rows", [1, 16, 17, 33, 72])
@pytest.mark.parametrize(("n", "k"), [(32, 32), (96, 576), (64, 1536)])
def test_tile_linear_equals_the_bfloat16_product(rows, n, k):
    """float32 sums of the bfloat16 products, rounded once: on AMX tiles where the kernels run on
    them (`tile_amx`), else in plain loops over the same layout. Rows past a tile's sixteen, and
    rows that fill no pair of tiles, are right too."""
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    got = torch.ops.tandem_cpu.tile_linear(x, torch.ops.tandem_cpu.tile_pack(w))
    expected = (x.double() @ w.double().T).float()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), expected, rtol=8e-3, atol=1e-4 * k**0.5)


def test_the_kernels_run_on_the_tiles_exactly_where_the_cpu_the_build_and_the_environment_allow():
    """On the tiles where the CPU has them and this build multiplies bfloat16 pairs, unless
    `TANDEM_CPU_TILES=0` (as a process started so says); else `tile_linear` and the bfloat16
    prompt attention run their other paths."""
    from cluster.cpu import cpu_flags

    expected = "amx_bf16" in cpu_flags() and "amx_tile" in cpu_flags() and cpu_kernels.variant() == "avx512_bf16"
    expected = expected and os.environ.get("TANDEM_CPU_TILES") != "0"
    assert torch.ops.tandem_cpu.tile_amx() is expected is cpu_kernels.tile_amx()
    env = {**os.environ, "TANDEM_CPU_TILES": "0"}
    ask = "from cluster.model import cpu_kernels; print(cpu_kernels.tile_amx())"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", ask], env=env, cwd=root, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False"]


def test_tile_kernels_refuse_what_they_cannot_do():
    w = torch.randn(64, 96).bfloat16()
    with pytest.raises(RuntimeError, match="n a multiple of 32 and k of 32"):
        torch.ops.tandem_cpu.tile_pack(w[:48])
    with pytest.raises(RuntimeError, match="bfloat16 weight"):
        torch.ops.tandem_cpu.tile_pack(w.float())
    packed = torch.ops.tandem_cpu.tile_pack(w)
    with pytest.raises(RuntimeError, match="x has 64 columns, the weight 96"):
        torch.ops.tandem_cpu.tile_linear(torch.randn(3, 64).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="bfloat16 x"):
        torch.ops.tandem_cpu.tile_linear(torch.randn(3, 96), packed)
    with pytest.raises(RuntimeError, match="packed by tile_pack"):
        torch.ops.tandem_cpu.tile_linear(torch.randn(3, 96).bfloat16(), w)
    with pytest.raises(RuntimeError, match="packed by tile_pack"):  # column tiles come in pairs
        torch.ops.tandem_cpu.tile_linear(torch.randn(3, 96).bfloat16(), packed[:3])
