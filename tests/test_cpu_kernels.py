"""The CPU kernels (`cluster/cpu_kernels.py`) against torch's own paths on the same inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cluster import cpu_kernels
from cluster.attention import (
    SeqChunk,
    _attend_padded,
    _write_kv,
    build_attention_metadata,
    dequantize_rows,
    paged_attention,
    quantize_rows,
)
from cluster.model import REDUCTION_MAX_ROWS, Linear

BLOCK = 8
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler to build the CPU kernels")


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
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 16), (8, 2, 128), (6, 2, 24)])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_attention_equals_sdpa(dtype, heads, kv_heads, head_dim, window):
    """Vector path (head_dim a multiple of 16) and scalar path (24), grouped and plain heads, with and
    without a sliding window."""
    q, k_cache, v_cache, meta = _case(dtype, heads, kv_heads, head_dim)
    (g,) = meta.groups
    got = torch.ops.tandem_cpu.decode_attention(q, k_cache, v_cache, g.block_tables, g.masks[window], 0.3)
    expected = _sdpa(q.float(), k_cache.float(), v_cache.float(), meta, window, 0.3)
    assert got.dtype == dtype and got.shape == expected.shape
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_few_row_linear_equals_f_linear(dtype):
    """`Linear` writes compiled one- and two-row CPU products as reductions; more rows stay GEMMs."""
    gen = torch.Generator().manual_seed(1)
    layer = Linear(96, 40, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=gen))
        layer.bias.copy_(torch.randn(40, generator=gen))
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    for rows in range(1, REDUCTION_MAX_ROWS + 2):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        with torch.inference_mode():
            got, expected = compiled(x), F.linear(x, layer.weight, layer.bias)
        assert got.dtype == dtype and got.shape == (rows, 40)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
