"""Strict weight loading from a Hugging Face model folder.

One table (`cluster.model.weights.weight_table`) maps each Hugging Face tensor name to a parameter of
`cluster.model.causal_lm.CausalLM` and, for fused projections, the row slice it fills. Loading raises,
naming the tensor, on anything missing, extra, mis-shaped or of a non-float type: a silent partial load
is the worst bug a server can have. Both a single `model.safetensors` and shards listed by
`model.safetensors.index.json` are read. A `.gguf` file is refused: the edges (the command line, the
workers, the router, the tokenizer) make it a folder once, with `cluster.model.gguf.model_folder`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from cluster.model import hugepages, prepack
from cluster.model.arch import ModelArch, ModelFormatError, model_dir
from cluster.model.causal_lm import CausalLM, rope_inv_freq
from cluster.model.quant import quantize, quantized_skeleton
from cluster.model.weights import DTYPES, INDEX_FILE, QUANT_KEY, SINGLE_FILE, weight_table

# Buffers some older checkpoints saved; they are recomputed from the config.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelFormatError(f"{index} is not a valid safetensors index: {e}") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
    elif (folder / SINGLE_FILE).exists():
        files = [folder / SINGLE_FILE]
    else:
        raise ModelFormatError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    for f in files:
        if not f.exists():
            raise ModelFormatError(f"weight shard {f} listed in {INDEX_FILE} is missing")
    return files


def iter_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    yield name, f.get_tensor(name)
        except ModelFormatError:
            raise
        except Exception as e:  # safetensors raises its own error types for a corrupt header
            raise ModelFormatError(f"cannot read {path}: {e}") from None


def _empty(model: nn.Module, device: str, dtype: torch.dtype) -> nn.Module:
    """`model`, built on the meta device, with uninitialised tensors on `device`, its floating-point
    ones in `dtype`: `Module.to_empty(...).to(dtype)` without a pass over the values, and without
    the reference `empty_like` that a meta tensor goes through, which imports sympy (a second)."""
    return model._apply(
        lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
    )


def load_weights(model: CausalLM, folder: Path) -> None:
    """Fills every parameter of `model` from `folder`, or raises naming the first problem."""
    table = weight_table(model.arch)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    tied_head: torch.Tensor | None = None
    for name, tensor in iter_tensors(folder):
        if _IGNORED.fullmatch(name):
            continue
        if name == "lm_head.weight" and model.arch.tie_word_embeddings:
            tied_head = tensor  # allowed when it repeats the embedding; checked below
            continue
        target = table.get(name)
        if target is None:
            raise ModelFormatError(f"unexpected tensor {name!r} in {folder} (not part of {model.arch.architecture})")
        if name in seen:
            raise ModelFormatError(f"tensor {name!r} appears twice in {folder}")
        if not tensor.is_floating_point():
            raise ModelFormatError(f"tensor {name!r} has non-float dtype {tensor.dtype}")
        param = params[target.param]
        dest = param.data if target.rows is None else param.data[target.rows[0] : target.rows[1]]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ModelFormatError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        seen.add(name)
    missing = sorted(set(table) - seen)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelFormatError(f"missing tensor {missing[0]!r}{more} in {folder}")
    embedding = params["embed_tokens.weight"].data
    if tied_head is not None and not torch.equal(tied_head.to(embedding.dtype), embedding):
        raise ModelFormatError("lm_head.weight differs from the embedding but tie_word_embeddings is true")


def load_model(
    folder: str | Path,
    dtype: str = "float32",
    device: str = "cpu",
    weight_dtype: str = "auto",
    group_size: int = 128,
    quantize_lm_head: bool = True,
    prepack_weights: str = "auto",
    huge_pages: str = "auto",
) -> CausalLM:
    """Builds `CausalLM` from a model folder's config and weights, in `dtype` on `device`; with
    `weight_dtype` int8 or int4 its linear layers are quantised (`cluster.model.quant`). A folder written
    by `save_quantized` loads as it was saved (its `weight_dtype` must be "auto" or the folder's).
    Its layers' weights are packed for prompt products as `prepack_weights` says (`cluster.model.prepack`),
    and its tensors of a page or more moved onto huge pages as `huge_pages` says (`cluster.model.hugepages`).
    A `.gguf` file is refused: pass it through `cluster.model.gguf.model_folder` first."""
    folder = model_dir(folder)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})")
    arch = ModelArch.from_folder(folder)
    with torch.device("meta"):
        model = CausalLM(arch, draw_weights=False)
    model = _empty(model, device, DTYPES[dtype])
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # made apart; tie again
    model.inv_freq = rope_inv_freq(arch.rope, arch.head_dim).to(device)  # stays float32
    saved = json.loads((folder / "config.json").read_text()).get(QUANT_KEY)
    huge = hugepages.wanted(huge_pages, device)
    if huge and saved is None and weight_dtype == "auto":  # read the weights in where they will stay
        hugepages.rehome(model, values=False)
        huge = False
    if saved is not None:
        if weight_dtype not in ("auto", saved["weight_dtype"]):
            raise ValueError(f"{folder} holds {saved['weight_dtype']} weights; it cannot load as {weight_dtype}")
        quantized_skeleton(model, saved["weight_dtype"], saved["group_size"], saved["lm_head"])
        _load_state(model, folder)
    else:
        load_weights(model, folder)
        quantize(model, weight_dtype, group_size, quantize_lm_head)
    model.eval().requires_grad_(False)
    if huge:
        hugepages.rehome(model)
    if prepack.wanted(prepack_weights, DTYPES[dtype], device):
        prepack.prepack(model)
    return model


def save_quantized(model: CausalLM, source: Path, out: Path) -> None:
    """Writes a quantised `model` (loaded from `source`) as a folder `load_model` reads back:
    `source`'s config (plus how it was quantised), tokenizer and generation files, and the
    model's own tensors (Tandem's names, the quantised weights as they are)."""
    from safetensors.torch import save_file

    if getattr(model, "quantization", None) is None:
        raise ValueError("the model is not quantised")
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix in (".json", ".txt", ".jinja") and path.name != INDEX_FILE:
            (out / path.name).write_bytes(path.read_bytes())
    config = json.loads((source / "config.json").read_text())
    config[QUANT_KEY] = model.quantization
    (out / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if _tied_head(model):
        del state["lm_head.weight"]
    save_file(state, str(out / SINGLE_FILE))


def _tied_head(model: CausalLM) -> bool:
    """Whether the LM head is the embedding table itself (tied and left unquantised). Asked of the
    modules: `state_dict()` detaches each tensor, so its entries are never the same object."""
    return getattr(model.lm_head, "weight", None) is model.embed_tokens.weight


def _load_state(model: CausalLM, folder: Path) -> None:
    """Loads a folder `save_quantized` wrote: exactly the model's own tensors, or an error naming one."""
    expected = model.state_dict()
    if _tied_head(model):
        expected.pop("lm_head.weight")
    state = dict(iter_tensors(folder))
    for name in sorted(set(expected) | set(state)):
        if name not in state:
            raise ModelFormatError(f"missing tensor {name!r} in {folder}")
        if name not in expected:
            raise ModelFormatError(f"unexpected tensor {name!r} in {folder}")
        if state[name].shape != expected[name].shape or state[name].dtype != expected[name].dtype:
            raise ModelFormatError(
                f"tensor {name!r} is {state[name].dtype} {tuple(state[name].shape)}, expected "
                f"{expected[name].dtype} {tuple(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=False)


def export_weights(model: CausalLM) -> dict[str, torch.Tensor]:
    """The inverse of `load_weights`: `model`'s parameters under their Hugging Face names."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name, target in weight_table(model.arch).items():
        tensor = params[target.param].detach()
        out[name] = (tensor if target.rows is None else tensor[target.rows[0] : target.rows[1]]).contiguous()
    return out
