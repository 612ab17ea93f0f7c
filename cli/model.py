"""`tandem model ...` and `tandem config check`, and the offline half of `tandem generate`: the
commands that need no cluster. A `.gguf` file given where a model folder is expected is imported
into a folder here, at the edge (`cluster.model.gguf.model_folder`).

tandem model init --preset tiny --out DIR     write a random-weight model folder
tandem model quantize --model DIR --out DIR   write a weight-only int8 or int4 copy of a model folder
tandem model import-gguf FILE --out DIR       write the model folder of a llama.cpp GGUF file
tandem config check FILE                      validate a cluster config file
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cluster.config import load_config
from cluster.cpu import auto_dtype
from cluster.model.arch import ARCHITECTURES, PRESETS


def add_commands(commands: argparse._SubParsersAction) -> None:
    """`model init | quantize | import-gguf` and `config check`."""
    model = commands.add_parser("model", help="build model folders").add_subparsers(required=True, metavar="ACTION")
    init = model.add_parser("init", help="write a random-weight model folder (config, weights, tokenizer)")
    init.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="size and shape (default: tiny)")
    init.add_argument("--arch", choices=sorted(ARCHITECTURES), default="LlamaForCausalLM", help="architecture")
    init.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="weight dtype on disk")
    init.add_argument("--seed", type=int, default=0, help="weight seed")
    init.add_argument("--max-shard-mb", type=float, default=None, help="split weights into shards of this size")
    init.add_argument("--out", required=True, help="folder to write")
    init.set_defaults(run=_model_init)
    quant = model.add_parser("quantize", help="write a weight-only quantised copy of a model folder")
    quant.add_argument("--model", required=True, help="the model folder (or .gguf file) to read")
    quant.add_argument("--weight-dtype", choices=["int8", "int4"], required=True, help="int8 or int4 weights")
    quant.add_argument("--group-size", type=int, choices=[32, 64, 128, 256], default=128, help="int4 group size")
    quant.add_argument("--keep-lm-head", action="store_true", help="leave the LM head unquantised")
    quant.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="scales' and activations' dtype"
    )
    quant.add_argument("--out", required=True, help="folder to write")
    quant.set_defaults(run=_model_quantize)
    gguf = model.add_parser("import-gguf", help="write the model folder of a llama.cpp GGUF file")
    gguf.add_argument("file", help="the .gguf file")
    gguf.add_argument("--out", required=True, help="folder to write (absent or empty)")
    gguf.add_argument(
        "--keep-quantized",
        action="store_true",
        help="keep Q4_0/Q4_1 blocks as int4 weights (group size 32) instead of dequantising them",
    )
    gguf.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="with --keep-quantized: scales', embedding's and norms' dtype, the one the folder loads in "
        "(default float32, which holds the file's fp16 scales exactly)",
    )
    gguf.set_defaults(run=_model_import_gguf)

    config = commands.add_parser("config", help="cluster config files").add_subparsers(required=True, metavar="ACTION")
    check = config.add_parser("check", help="validate a YAML or JSON cluster config")
    check.add_argument("file")
    check.set_defaults(run=_config_check)


def _model_init(args: argparse.Namespace) -> None:
    from cluster.model.builder import init_model_folder

    shard = int(args.max_shard_mb * 2**20) if args.max_shard_mb else None
    out = init_model_folder(args.out, args.preset, args.arch, args.dtype, args.seed, shard)
    print(f"wrote {args.preset} {args.arch} ({args.dtype}) to {out}")


def _model_quantize(args: argparse.Namespace) -> None:
    from cluster.model.gguf import model_folder
    from cluster.model.loader import load_model, save_quantized
    from cluster.model.quant import weight_bytes

    source = model_folder(args.model)  # a .gguf file is imported once, then read from its folder
    model = load_model(source, args.dtype, "cpu", args.weight_dtype, args.group_size, not args.keep_lm_head)
    save_quantized(model, source, Path(args.out))
    mib = weight_bytes(model) / 2**20
    print(f"wrote {args.weight_dtype} weights of {source} to {args.out} ({mib:.1f} MiB read per step)")


def _model_import_gguf(args: argparse.Namespace) -> None:
    from cluster.model.gguf import import_gguf

    print(import_gguf(args.file, args.out, args.keep_quantized, args.dtype).summary())


def offline_generate(args: argparse.Namespace) -> None:
    """`tandem generate --model DIR`: the model in this process, no cluster."""
    from cluster.generate import generate
    from cluster.model.gguf import model_folder
    from cluster.model.loader import load_model
    from cluster.model.tokenizer import Tokenizer

    folder = model_folder(args.model)  # a .gguf file is imported once, then read from its folder
    model = load_model(folder, auto_dtype("cpu")[0] if args.dtype == "auto" else args.dtype)
    tok = Tokenizer(folder)
    chat = [{"role": "user", "content": args.prompt}]
    prompt = tok.encode_chat(chat) if args.chat else tok.encode(args.prompt)
    start = time.perf_counter()
    result = generate(
        model,
        [prompt],
        args.max_tokens,
        eos_token_ids=tok.eos_token_ids,
        temperature=args.temperature,
        seed=args.seed,
    )[0]
    elapsed = time.perf_counter() - start
    print(args.prompt + tok.decode(result.tokens))
    print(
        f"[{len(prompt)} prompt tokens, {len(result.tokens)} generated, finish: {result.finish_reason}, "
        f"{elapsed:.2f} s]",
        file=sys.stderr,
    )


def _config_check(args: argparse.Namespace) -> None:
    config = load_config(args.file)
    print(f"{args.file}: valid (model {config.model.path}, transport {config.transfer.transport})")
