"""A GGUF file's tensors as Tandem weights: dequantised under their Hugging Face names, or with
Q4_0/Q4_1 blocks kept as `cluster.model.quant.Int4Linear` weights (group size 32), and a Q8_0 LM head's
blocks as an `Int8Linear`'s (a scale per block of 32).

llama.cpp's converter reorders the rows of Llama's `q_proj` and `k_proj` within each head (its
RoPE rotates interleaved pairs, Hugging Face's rotates halves); `unpermute` puts them back. Rows
are whole in every format, so quantised blocks are reordered as they are.

A Q4_1 block holds 32 weights as `d * q + m` (fp16 `d`, `m`; 4-bit `q`), which is Int4Linear's
`minimum + q * scale`; a Q4_0 block holds `d * (q - 8)`, that is minimum `-8 d`. Both come across
as the file's own numbers, so the int4 model computes with exactly the file's weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from cluster.model.arch import ModelArch, ModelFormatError
from cluster.model.causal_lm import CausalLM
from cluster.model.weights import weight_table

# Hugging Face name inside `model.layers.{i}.` -> GGUF name inside `blk.{i}.`
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
Q4_TYPES = ("Q4_0", "Q4_1")
_Q4_BLOCK = 32


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{layer}.{_LAYER_NAMES[rest]}"


def check_names(arch: ModelArch, names: Iterable[str]) -> dict[str, str]:
    """Hugging Face name -> GGUF name of every weight the model takes; raises naming a GGUF tensor
    the file lacks or one the model does not take."""
    wanted = {gguf_name(hf): hf for hf in weight_table(arch)}
    names = set(names)
    unexpected = sorted(names - set(wanted))
    if unexpected:
        raise ModelFormatError(
            f"unexpected tensor {unexpected[0]!r} in the GGUF file (not part of {arch.architecture})"
        )
    missing = sorted(set(wanted) - names)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelFormatError(f"missing tensor {missing[0]!r}{more} in the GGUF file")
    return {hf: g for g, hf in wanted.items()}


def heads_permuted(arch: ModelArch, hf_name: str) -> int | None:
    """How many heads llama.cpp permuted `hf_name`'s rows over (None: not permuted)."""
    if arch.architecture != "LlamaForCausalLM":
        return None
    if ".self_attn.q_proj." in hf_name:
        return arch.num_heads
    if ".self_attn.k_proj." in hf_name:
        return arch.num_kv_heads
    return None


def unpermute(rows: np.ndarray, heads: int | None) -> np.ndarray:
    """Undoes llama.cpp's `permute`: each head's rows, stored as (half, pair) interleaved, go back
    to (pair, half) order. Works on any trailing shape (values, blocks, scales)."""
    if heads is None:
        return rows
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def dequantize(tensor: Any, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of a `gguf.ReaderTensor` in torch order, or an error naming its type."""
    from gguf.quants import dequantize as gguf_dequantize

    data = _checked(tensor, shape).view(np.ndarray)  # the mapped bytes, without np.memmap's per-slice overhead
    try:
        values = gguf_dequantize(data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelFormatError(
            f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, which gguf cannot dequantise (not supported)"
        ) from None
    values = np.asarray(values, dtype=np.float32).reshape(shape)
    return values if values.flags.writeable else values.copy()  # F32 comes back as a view of the file


def _checked(tensor: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor's stored data, once its shape (torch order) is the one the model wants."""
    stored = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    if stored != shape:
        raise ModelFormatError(f"tensor {tensor.name!r} has shape {stored}, expected {shape}")
    return tensor.data


def float_state(arch: ModelArch, tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Hugging Face name -> dequantised tensor: float16 / bfloat16 tensors keep their type (exact),
    everything else is float32."""
    expected = expected_shapes(arch)
    state = {}
    for hf, g in check_names(arch, tensors).items():
        values = unpermute(dequantize(tensors[g], expected[hf]), heads_permuted(arch, hf))
        dtype = {"F16": torch.float16, "BF16": torch.bfloat16}.get(tensors[g].tensor_type.name, torch.float32)
        state[hf] = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
    return state


def expected_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> the shape the model wants."""
    with torch.device("meta"):
        params = dict(CausalLM(arch, draw_weights=False).named_parameters())
    shapes = {}
    for hf, target in weight_table(arch).items():
        shape = tuple(params[target.param].shape)
        shapes[hf] = shape if target.rows is None else (target.rows[1] - target.rows[0], *shape[1:])
    return shapes


def q4_parts(tensor: Any, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values uint8 [N, K] in [0, 15], scales float32 [N, K / 32], minimums float32 [N, K / 32])
    of a Q4_0 or Q4_1 tensor: w = minimum + values * scale, blockwise."""
    kind = tensor.tensor_type.name
    n, k = shape
    offset = 2 if kind == "Q4_0" else 4  # d, then (Q4_1) m, then 16 bytes of nibbles
    blocks = _checked(tensor, shape).view(np.ndarray).reshape(n, k // _Q4_BLOCK, offset + 16)
    scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_0":
        minimums = -8 * scales
    else:
        minimums = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., offset:]
    values = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1)  # a block's first 16 weights are the low nibbles
    return values.reshape(n, k), scales, minimums


def linear_modules(arch: ModelArch) -> set[str]:
    with torch.device("meta"):
        model = CausalLM(arch, draw_weights=False)
    return {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def int4_state(
    arch: ModelArch, tensors: dict[str, Any], dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], bool | str, list[str]]:
    """(Tandem's state dict with every linear layer's Q4_0/Q4_1 blocks as Int4Linear buffers, the
    LM head's form (True: int4; "int8": its Q8_0 blocks kept as an Int8Linear's; False: float),
    notes on what was dequantised). The embedding table and the norms are dequantised (Tandem keeps
    them in float); an LM head that can stay neither int4 nor int8 stays in float too. Any other
    linear weight that cannot stay int4 is refused, by name."""
    names = check_names(arch, tensors)
    expected, linears = expected_shapes(arch), linear_modules(arch)
    pieces: dict[str, list[tuple[int, str]]] = {}
    for hf, target in weight_table(arch).items():
        pieces.setdefault(target.param, []).append((target.rows[0] if target.rows else 0, hf))
    state: dict[str, torch.Tensor] = {}
    notes: list[str] = []
    for param, parts in pieces.items():
        hfs = [hf for _, hf in sorted(parts)]
        module, kind = param.rsplit(".", 1)
        files = [(names[hf], tensors[names[hf]].tensor_type.name) for hf in hfs]
        if module in linears and kind == "weight":
            problem = _int4_problem(files, sum(expected[hf][0] for hf in hfs))
            if problem is None:
                state |= _int4_buffers(
                    module, [(tensors[names[hf]], expected[hf], heads_permuted(arch, hf)) for hf in hfs], dtype
                )
                continue
            if module == "lm_head" and [kind for _, kind in files] == ["Q8_0"]:
                state |= _int8_buffers(tensors[names[hfs[0]]], expected[hfs[0]], dtype)
                continue
            if module != "lm_head":
                raise ModelFormatError(problem)
        values = [unpermute(dequantize(tensors[names[hf]], expected[hf]), heads_permuted(arch, hf)) for hf in hfs]
        state[param] = torch.from_numpy(np.concatenate(values)).to(dtype)
        notes += [f"{name} ({kind}) dequantised" for name, kind in files if kind not in _FLOATS]
    embedding = tensors["token_embd.weight"]
    if arch.tie_word_embeddings:
        if _int4_problem([(embedding.name, embedding.tensor_type.name)], arch.vocab_size) is None:
            state |= _int4_buffers("lm_head", [(embedding, expected["model.embed_tokens.weight"], None)], dtype)
        elif embedding.tensor_type.name == "Q8_0":
            state |= _int8_buffers(embedding, expected["model.embed_tokens.weight"], dtype)
        else:
            notes.append("the LM head is the embedding table (tied), in float")
    head = True if "lm_head.nibbles" in state else "int8" if "lm_head.scales" in state else False
    return state, head, notes


def _int8_buffers(tensor: Any, shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The LM head's buffers as an Int8Linear with a scale per block of 32 (`quant.Q8_0_BLOCK`),
    from a Q8_0 tensor's blocks as they are: w = scale * value, blockwise."""
    n, k = shape
    blocks = _checked(tensor, shape).view(np.ndarray).reshape(n, k // 32, 2 + 32)  # d, then 32 int8 values
    scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    values = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
    return {"lm_head.weight": torch.from_numpy(values), "lm_head.scales": torch.from_numpy(scales).to(dtype)}


_FLOATS = ("F32", "F16", "BF16")
_INT4_ROWS = 16  # torch._convert_weight_to_int4pack_for_cpu packs rows in sixteens


def _int4_problem(files: list[tuple[str, str]], rows: int) -> str | None:
    """Why a linear weight made of GGUF tensors `files` ((name, type) each) cannot stay int4, or None."""
    for name, kind in files:
        if kind not in Q4_TYPES:
            why = " (Q8_0 blocks are kept for the LM head only)" if kind == "Q8_0" else ""
            return (
                f"tensor {name!r} is {kind}: keeping quantised weights takes Q4_0/Q4_1 blocks only{why}; "
                "import without keep-quantized to dequantise it"
            )
    if rows % _INT4_ROWS:
        named = ", ".join(name for name, _ in files)
        return f"{named}: {rows} rows, and torch's int4 kernel needs a multiple of {_INT4_ROWS}"
    return None


def _int4_buffers(
    module: str, parts: list[tuple[Any, tuple[int, ...], int | None]], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Int4Linear's saved buffers for `module`, its rows filled from each Q4 tensor in turn."""
    columns = zip(*[[unpermute(a, heads) for a in q4_parts(t, shape)] for t, shape, heads in parts], strict=True)
    values, scales, minimums = (np.concatenate(column) for column in columns)
    return {
        f"{module}.nibbles": torch.from_numpy(values[:, 0::2] | (values[:, 1::2] << 4)),  # two a byte, in order
        f"{module}.scales": torch.from_numpy(scales).to(dtype),
        f"{module}.minimums": torch.from_numpy(minimums).to(dtype),
    }
