"""GGUF import: a llama.cpp `.gguf` file becomes a Tandem model folder.

`import_gguf(file, out)` writes `config.json`, `generation_config.json`, `tokenizer.json`,
`tokenizer_config.json` (special tokens, chat template) and `model.safetensors`: by default the
tensors dequantised under their Hugging Face names (F16/BF16 kept as they are, everything else in
float32), or, with `keep_quantized`, Q4_0/Q4_1 blocks kept as Tandem's int4 weights in the folder
form `cluster.model.loader.save_quantized` writes. The pieces live in `gguf_meta` (config),
`gguf_tokenizer` and `gguf_tensors`.

`model_folder(path)` is what every entry point that takes a model folder calls: a folder comes
back as it is; a `.gguf` file is imported once into `<cache_dir>/<sha256 of the file>-<variant>-v<N>`
(default cache dir `~/.cache/tandem/gguf`) and that folder comes back. The import is written to a
temporary folder beside it and renamed into place, so processes importing the same file at once
are safe and a half-written folder is never used.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from cluster.model.arch import ModelArch, ModelFormatError

DEFAULT_CACHE_DIR = Path("~/.cache/tandem/gguf")
# Part of each cache folder's name: raise it when the import writes something different.
IMPORT_VERSION = 2  # 2: a Q8_0 LM head of a kept import stays int8


@dataclass(frozen=True)
class ImportReport:
    source: Path
    out: Path
    architecture: str
    tensor_types: dict[str, int]  # GGUF tensor type -> how many tensors have it
    keep_quantized: bool
    notes: tuple[str, ...]  # what was dequantised although keep_quantized asked otherwise
    seconds: float

    def summary(self) -> str:
        types = ", ".join(f"{n} {kind}" for kind, n in sorted(self.tensor_types.items(), key=lambda kv: -kv[1]))
        weights = "Q4_0/Q4_1 kept as int4" if self.keep_quantized else "dequantised"
        lines = [
            f"imported {self.source} ({self.architecture}; {types}) to {self.out}, {weights}, in {self.seconds:.1f} s"
        ]
        return "\n".join(lines + [f"  {note}" for note in self.notes])


def import_gguf(
    path: str | Path, out: str | Path, keep_quantized: bool = False, dtype: str = "float32"
) -> ImportReport:
    """Writes the model folder of GGUF file `path` to `out` (absent or empty). `dtype` is the
    float type of a keep-quantized folder's scales, embedding and norms: float32 holds the file's
    fp16 scales exactly; such a folder loads in that dtype only."""
    from safetensors.torch import save_file

    from cluster.model.gguf_meta import generation_config, hf_config, open_gguf, read_metadata, tensor_shapes
    from cluster.model.gguf_tensors import float_state, int4_state
    from cluster.model.gguf_tokenizer import build_tokenizer
    from cluster.model.weights import DTYPES, QUANT_KEY, SINGLE_FILE

    start = time.perf_counter()
    path, out = Path(path), Path(out)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder")
    reader = open_gguf(path)
    meta, shapes = read_metadata(reader), tensor_shapes(reader)
    config = hf_config(meta, shapes)
    arch = ModelArch.from_hf_config(config)
    tokenizer, tokenizer_config = build_tokenizer(meta)
    tensors = {t.name: t for t in reader.tensors}
    notes: list[str] = []
    if keep_quantized:
        state, lm_head, notes = int4_state(arch, tensors, DTYPES[dtype])
        config[QUANT_KEY] = {"weight_dtype": "int4", "group_size": 32, "lm_head": lm_head}
        config["torch_dtype"] = dtype
    else:
        state = float_state(arch, tensors)
    config["tandem_gguf"] = {"source": path.name, "sha256": file_sha256(path), "keep_quantized": keep_quantized}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / SINGLE_FILE), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    for name, data in (
        ("config.json", config),
        ("generation_config.json", generation_config(meta)),
        ("tokenizer_config.json", tokenizer_config),
    ):
        (out / name).write_text(json.dumps(data, indent=2, ensure_ascii=False))
    types = Counter(t.tensor_type.name for t in reader.tensors)
    seconds = time.perf_counter() - start
    return ImportReport(path, out, meta["general.architecture"], dict(types), keep_quantized, tuple(notes), seconds)


def model_folder(path: str | Path, cache_dir: str | Path | None = None, keep_quantized: bool = False) -> Path:
    """`path` if it is a model folder; for a `.gguf` file, its imported folder under `cache_dir`
    (default `~/.cache/tandem/gguf`), importing it the first time."""
    path = Path(path)
    if path.suffix.lower() != ".gguf":
        return path
    if not path.is_file():
        raise ModelFormatError(f"{path} is missing or not a file")
    root = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    variant = "int4" if keep_quantized else "float"
    folder = root / f"{file_sha256(path)[:32]}-{variant}-v{IMPORT_VERSION}"
    if folder.is_dir():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
    try:
        import_gguf(path, staging, keep_quantized)
        staging.rename(folder)
    except OSError:
        if not folder.is_dir():  # another process renamed its import into place first: use that
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def file_sha256(path: Path) -> str:
    stat = path.stat()
    return _sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    # Keyed on size and mtime too, so a file rewritten in place is hashed again.
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
