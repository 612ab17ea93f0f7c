"""`tandem generate`: stream a completion from a running cluster through the client SDK, or, with
`--model`, complete the prompt in this process (`cli.model.offline_generate`).

tandem generate PROMPT [--target HOST:PORT]   stream a completion from a running cluster
tandem generate --model DIR --prompt TEXT     complete a prompt in this process, no cluster
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from cli.client_options import add_client_options
from cli.model import offline_generate
from router.sdk.client import Client


def add_commands(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser("generate", help="stream a completion from a running cluster (or --model: locally)")
    gen.add_argument("text", nargs="?", help="the prompt")
    gen.add_argument("--prompt", default=None, help="the prompt (same as the positional argument)")
    add_client_options(gen)
    gen.add_argument("--model", default=None, help="run this model folder (or .gguf file) in this process instead")
    gen.add_argument("--timeout", type=float, default=120.0, help="seconds before giving up (default: 120)")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default: 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
        help="compute dtype (--model); auto: bfloat16 where the CPU multiplies it natively, else float32",
    )  # fmt: skip
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--adapter", default="", help="the LoRA adapter to run through, by name (--target only)")
    gen.set_defaults(run=_generate)


def _generate(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else args.text
    if prompt is None:
        raise ValueError("give a prompt: tandem generate 'def add(a, b):'")
    if args.model is not None:
        if args.adapter:
            raise ValueError("--adapter names an adapter a cluster serves: use it with --target, not --model")
        args.prompt = prompt
        offline_generate(args)
        return 0
    messages = [{"role": "user", "content": prompt}] if args.chat else prompt
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    if args.adapter:
        sampling["adapter"] = args.adapter
    stream(args.target, messages, timeout=args.timeout, api_key=args.api_key, tls_ca=args.tls_ca, **sampling)
    return 0


def stream(
    target: str,
    prompt: str | Sequence[dict[str, str]],
    timeout: float = 120.0,
    api_key: str | None = None,
    tls_ca: str | None = None,
    **sampling: Any,
) -> None:
    """Prints the prompt (a chat: each message), then the completion as it streams, then why it finished."""
    with Client(target, api_key=api_key, timeout=timeout, tls_ca=tls_ca) as client:
        if isinstance(prompt, str):
            print(prompt, end="", flush=True)
        else:
            print("".join(f"{m['role']}: {m['content']}\n" for m in prompt) + "assistant: ", end="", flush=True)
        reason = None
        for delta in client.stream(prompt, **sampling):
            print(delta.text, end="", flush=True)
            reason = delta.finish_reason or reason
        print(f"\n[finish: {reason}]", file=sys.stderr)
