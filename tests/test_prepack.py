"""Weights packed once for oneDNN (`cluster.model.prepack`): prompt products on the packed copy equal the
layers' own, few-row and compiled products keep theirs, a packed model scores as the plain one, and
`prepack_weights` packs where it says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from cluster.config import ModelConfig
from cluster.model import cpu_kernels, prepack
from cluster.model.causal_lm import Linear
from cluster.model.loader import load_model
from cluster.model.quality import agreement, random_windows, score
from cluster.model.quant import Int4Linear, Int8Linear

DEMO = Path(__file__).resolve().parents[1] / "models" / "tandem-demo-code"
BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(
        not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN runs no bfloat16 products on this CPU"
    ),
)
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 5e-2)}


@pytest.fixture
def products(monkeypatch) -> list[int]:
    """Rows of every product run on a packed weight."""
    rows: list[int] = []
    real = prepack.product

    def counted(x, packed, bias):  # type: ignore[no-untyped-def]
        rows.append(x.shape[0])
        return real(x, packed, bias)

    monkeypatch.setattr(prepack, "product", counted)
    return rows


def _layers(dtype: torch.dtype) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    plain = Linear(256, 96, bias=True, dtype=dtype).requires_grad_(False)
    return [plain, Int8Linear.from_linear(plain), Int4Linear.from_linear(plain, group_size=64)]


def _pack(module: torch.nn.Module) -> None:
    weight = module.dense() if hasattr(module, "dense") else module.weight
    module.prepacked, module.prepacked_dtype = prepack.pack(weight), weight.dtype


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("rows", [17, 64, 300])
def test_a_packed_product_equals_the_layers_own(dtype, rows, products):
    """Plain, int8 and int4 layers: the packed copy (the weights dequantised) gives the dense product,
    bias included."""
    x = torch.randn(rows, 256, dtype=dtype)
    rtol, atol = TOLERANCE[dtype]
    for module in _layers(dtype):
        weight = module.dense() if hasattr(module, "dense") else module.weight
        expected = torch.nn.functional.linear(x.float(), weight.float(), module.bias.float())
        _pack(module)
        torch.testing.assert_close(module(x).float(), expected, rtol=rtol, atol=atol)
    plain_few = cpu_kernels.SKINNY_ROWS[dtype]  # float32's plain products stream the weight up to 64 rows
    assert products == [rows] * (3 if rows > plain_few else 2)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_few_rows_compiled_and_other_dtypes_keep_their_own_products(dtype, products, monkeypatch):
    module = _layers(dtype)[0]
    _pack(module)
    module(torch.randn(cpu_kernels.SKINNY_ROWS[dtype], 256, dtype=dtype))  # decode's rows: the plain weight
    module(torch.randn(80, 256, dtype=dtype))
    assert products == [80]
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    with pytest.raises(RuntimeError):  # a dtype the layer was not built in is an error, as in F.linear
        module(torch.randn(80, 256, dtype=other))
    assert not prepack.usable(module, torch.randn(80, 256, dtype=other))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not prepack.usable(module, torch.randn(80, 256, dtype=dtype))  # inductor packs its own


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("weights", ["auto", "int8"])
def test_a_packed_model_predicts_as_the_plain_one(dtype, weights, products):
    name = "float32" if dtype == torch.float32 else "bfloat16"
    windows = random_windows(512, length=128, count=2)
    plain = load_model(DEMO, name, weight_dtype=weights, prepack_weights="off")
    packed = load_model(DEMO, name, weight_dtype=weights, prepack_weights="on")
    assert all(m.prepacked is None for m in plain.layers.modules() if hasattr(m, "prepacked"))
    reference = score(plain, windows)
    assert not products
    got = score(packed, windows)
    assert products and min(products) > 16  # every layer's prompt products ran on the packed copies
    assert agreement(got, reference) >= (1.0 if dtype == torch.float32 else 0.97)
    assert abs(got.loss - reference.loss) <= (1e-4 if dtype == torch.float32 else 0.01) * reference.loss


def test_prepack_packs_every_layer_product_and_counts_its_bytes():
    model = load_model(DEMO, "float32", prepack_weights="off")
    linears = [m for m in model.layers.modules() if isinstance(m, Linear)]
    assert prepack.prepack(model) == sum(m.weight.numel() * 4 for m in linears)
    assert all(m.prepacked is not None for m in linears) and model.lm_head.prepacked is None
    prepack.unpack(model)
    assert all(m.prepacked is None for m in linears)


def test_auto_packs_bfloat16_on_a_cpu_with_amx_tiles_only(monkeypatch):
    import cluster.cpu

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    for flags, packs in ((frozenset({"avx512_bf16", "amx_bf16"}), True), (frozenset({"avx512_bf16"}), False)):
        monkeypatch.setattr(cluster.cpu, "cpu_flags", lambda flags=flags: flags)
        monkeypatch.delitem(cpu_kernels._state, "amx", raising=False)
        assert prepack.wanted("auto", torch.bfloat16, "cpu") is packs
        assert prepack.wanted("auto", torch.float32, "cpu") is False
        assert prepack.wanted("on", torch.float32, "cpu") is True
        assert prepack.wanted("off", torch.bfloat16, "cpu") is False
        assert prepack.wanted("on", torch.bfloat16, "cuda") is False
    with pytest.raises(ValueError, match="prepack_weights"):
        prepack.wanted("always", torch.bfloat16, "cpu")


def test_the_setting_is_validated():
    assert ModelConfig(path=DEMO).prepack_weights == "auto"
    with pytest.raises(ValidationError, match="prepack_weights"):
        ModelConfig(path=DEMO, prepack_weights="always")


def test_a_compiled_graph_runs_its_own_products_on_a_packed_layer(products):
    """Inductor traces the layer without its opaque packed copy and multiplies the plain weight."""
    module = _layers(torch.float32)[0]
    _pack(module)
    x = torch.randn(80, 256)
    compiled = torch.compile(module, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x), torch.nn.functional.linear(x, module.weight, module.bias))
    assert not products


@pytest.mark.parametrize(("n", "k"), [(96, 256), (48, 256), (96, 100)])
def test_bfloat16_weights_pack_for_the_tiles_where_the_kernels_run_on_them(n, k):
    """Sizes that are multiples of 32 go to the tile kernel where it runs on AMX tiles; other sizes,
    and other CPUs, to oneDNN. Either way the product is the dense one."""
    if not (cpu_kernels.available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("needs the CPU kernels and oneDNN's bfloat16 products")
    torch.manual_seed(0)
    w, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    tiles = torch.ops.tandem_cpu.tile_amx() and cpu_kernels.used() and n % 32 == 0 and k % 32 == 0
    assert prepack.tiles(w) is tiles
    packed = prepack.pack(w)
    assert (packed.dim() == 4) is tiles
    x = torch.randn(40, k).bfloat16()
    expected = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    torch.testing.assert_close(prepack.product(x, packed, bias).float(), expected, rtol=2e-2, atol=5e-2)
