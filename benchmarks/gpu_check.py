"""The GPU check in one run: what `benchmarks/gpu_check.sh` starts once the interpreter is set up.

    python benchmarks/gpu_check.py OUT_DIR [--dry-run] [--real-model DIR] [--budget-s S]

Each step runs in a process of its own, under a time limit taken from one budget, and whatever it
reports lands in OUT_DIR/gpu_check.json, rewritten after every step (a run cut short still leaves
what it measured). The steps:

1. `cuda_tests`: the tests marked `gpu` (tests/test_cuda.py: the model, the engine and compiled
   decode on CUDA against the CPU);
2. `decode`: decode steps against the HBM roofline measured beside them (benchmarks/gpu_steps.py);
3. `prefill`: prefill MFU against the bfloat16 matrix-multiply rate measured beside it (same file);
4. `kv_overlap`: layer-wise KV shipping, copies on their own CUDA stream, over gRPC to a receiving
   process: the share of the transfer hidden behind the pass (benchmarks/gpu_kv_overlap.py);
5. `transports`: `local` and `grpc` between a prefill and a decode engine on the one GPU, KV bit for
   bit and greedy tokens equal one engine (benchmarks/gpu_kv_nccl.py); the `collective` (NCCL) pair
   needs two GPUs, and the summary says it was not run and why.

Models: a random-weight Llama-shaped model of about 1B parameters (the `llama-1b` preset), and
the real model SmolLM2-135M-Instruct: its own weights where the folder has them, else random weights
in its own shape (its config.json alone travels to the GPU machine; decode and prefill times depend
on the shapes, not on the values). `--dry-run` runs every step on the CPU with tiny shapes, two
steps at a time (its times mean nothing, and each step's output is printed whole as it ends).

Writes OUT_DIR/gpu_check.json and, where matplotlib imports, OUT_DIR/gpu_{decode,prefill,kv_overlap}.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BENCH = ROOT / "benchmarks"
REAL = "SmolLM2-135M-Instruct"
REAL_SOURCES = (ROOT / ".cache" / "models" / REAL, ROOT / ".cache" / "gpu-carry" / REAL)
# Seconds each step may take on the GPU machine; a dry run allows each DRY_SLACK times as long (a shared
# 2-core CPU box runs the tiny shapes, and every process's imports, several times slower than that machine).
LIMITS = {"cuda_tests": 150, "decode": 100, "prefill": 40, "kv_overlap": 60, "transports": 60}
BUDGET_S = 420  # all the steps and the models' preparation: with the wheels' install, inside 8 minutes
DRY_SLACK = 4
DRY_JOBS = 2  # a dry run's steps at a time: their times mean nothing, and each is mostly one core's imports
PACKAGES = ("torch", "triton", "grpcio", "protobuf", "pydantic", "transformers", "safetensors", "numpy")


def environment(dry_run: bool) -> dict:
    from importlib import metadata

    import torch

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        import ray  # noqa: F401

        ray_importable = True
    except ImportError:
        ray_importable = False
    cuda = torch.cuda.is_available()
    return {
        "python": sys.version.split()[0],
        "packages": versions,
        "ray_importable": ray_importable,
        "cuda_available": cuda,
        "cuda_devices": torch.cuda.device_count() if cuda else 0,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "cuda_version": torch.version.cuda,
        "cpu_count": os.cpu_count(),
    }


def random_models(work: Path, dry_run: bool) -> dict[str, Path]:
    """The Llama-shaped random model (the tiny preset in a dry run), and the tiny one the transports use."""
    from cluster.model.builder import init_model_folder

    tiny = init_model_folder(work / "tiny", "tiny", dtype="bfloat16", seed=0)
    if dry_run:
        return {"random": tiny, "tiny": tiny}
    return {"random": init_model_folder(work / "random", "llama-1b", dtype="bfloat16", seed=0), "tiny": tiny}


def real_model(source: Path, work: Path) -> tuple[Path, str]:
    """The real model's folder, and where its weights come from: its own, or random in its shape."""
    import torch

    from cluster.model.builder import random_weights, save_weights

    if (source / "model.safetensors").exists() or (source / "model.safetensors.index.json").exists():
        return source, "its own"
    config = json.loads((source / "config.json").read_text())
    config.setdefault("initializer_range", 0.02)
    config["torch_dtype"] = "bfloat16"
    out = work / "real"
    out.mkdir(parents=True, exist_ok=True)
    save_weights({k: v.to(torch.bfloat16) for k, v in random_weights(config, seed=0).items()}, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, "random, in its own shape (only config.json was at hand)"


def dry_real_source(work: Path) -> Path:
    """The dry run's stand-in for the real model: a tiny config.json alone, as the GPU machine gets it."""
    from cluster.model.builder import PRESETS, hf_config

    folder = work / "real-config"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(PRESETS["tiny"], "LlamaForCausalLM", "float32")))
    return folder


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]
    limit_s: float
    result: Path | None = None  # the JSON the step writes


class Runner:
    """Runs the steps within one budget, one after another (`jobs` at a time in a dry run, each
    step's output held and printed whole as it ends); keeps the summary up to date on disk."""

    def __init__(self, summary: dict, path: Path, budget_s: float, jobs: int = 1) -> None:
        self.summary, self.path, self.jobs = summary, path, jobs
        self.deadline = time.monotonic() + budget_s
        self._lock = threading.Lock()  # the summary, its file and the log, between concurrent steps

    def save(self) -> None:
        with self._lock:
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(_finite(self.summary), indent=2, default=str, allow_nan=False))
            tmp.replace(self.path)

    def run_all(self, steps: list[Step]) -> dict[str, dict]:
        """Every step's outcome, by name; the summary lists them in this order whatever ends first."""
        for step in steps:
            self.summary["steps"][step.name] = {"status": "not run", "reason": "waiting for its turn"}
        with ThreadPoolExecutor(self.jobs) as pool:
            outcomes = list(pool.map(self.run, steps))
        return {step.name: outcome for step, outcome in zip(steps, outcomes, strict=True)}

    def run(self, step: Step) -> dict:
        left = self.deadline - time.monotonic()
        if left < 10:
            outcome = {"status": "not run", "reason": "the check's time budget was spent"}
            return self._record(step.name, outcome)
        heading = f"\n== {step.name}: {' '.join(step.argv[1:])}"
        held = tempfile.TemporaryFile() if self.jobs > 1 else None  # noqa: SIM115  (beside another step: printed at its end)
        if held is None:
            print(heading, flush=True)
        start = time.monotonic()
        # A group of its own: killed whole.
        process = subprocess.Popen(step.argv, cwd=ROOT, start_new_session=True, stdout=held, stderr=held)
        try:
            rc = process.wait(timeout=min(step.limit_s, left))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            rc = None
        if held is not None:
            held.seek(0)
            with self._lock:
                print(heading, flush=True)
                sys.stdout.buffer.write(held.read())
                sys.stdout.flush()
            held.close()
        outcome: dict = {"seconds": round(time.monotonic() - start, 1)}
        if rc is None:
            outcome["status"] = f"timed out after {min(step.limit_s, left):.0f} s"
        else:
            outcome["status"] = "passed" if rc == 0 else f"failed (exit {rc})"
        if step.result is not None and step.result.exists():
            outcome["result"] = json.loads(step.result.read_text())
        elif step.result is not None and rc == 0:
            outcome["status"] = "failed (no result written)"
        return self._record(step.name, outcome)

    def _record(self, name: str, outcome: dict) -> dict:
        with self._lock:
            self.summary["steps"][name] = outcome
        self.save()
        print(f"== {name}: {outcome['status']}", flush=True)
        return outcome


def junit_counts(path: Path) -> dict:
    if not path.exists():
        return {}
    suite = ET.parse(path).getroot().find("testsuite")
    assert suite is not None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    skipped = []
    for case in suite.iter("testcase"):
        skip = case.find("skipped")
        if skip is not None:
            skipped.append(f"{case.get('name')}: {skip.get('message', '')}")
    return {**counts, "skipped_tests": skipped}


def run_steps(runner: Runner, args: argparse.Namespace, work: Path, models: dict[str, Path]) -> None:
    py = sys.executable
    limits = {step: s * (DRY_SLACK if args.dry_run else 1) for step, s in LIMITS.items()}
    dry = ["--dry-run"] if args.dry_run else []
    junit = work / "cuda_tests.xml"
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_cuda.py",
              f"--junitxml={junit}"]  # fmt: skip
    steps = [Step("cuda_tests", pytest, limits["cuda_tests"])]
    model_args = [a for name in ("random", "real") for a in ("--model", f"{name}={models[name]}")]
    for step in ("decode", "prefill"):
        argv = [py, str(BENCH / "gpu_steps.py"), step, *model_args, "--result", str(work / f"{step}.json"), *dry]
        steps.append(Step(step, argv, limits[step], work / f"{step}.json"))
    argv = [py, str(BENCH / "gpu_kv_overlap.py"), "--model", str(models["random"]),
            "--result", str(work / "kv_overlap.json"), *dry]  # fmt: skip
    steps.append(Step("kv_overlap", argv, limits["kv_overlap"], work / "kv_overlap.json"))
    argv = [py, str(BENCH / "gpu_kv_nccl.py"), "--transport", "local,grpc,collective", "--model", str(models["tiny"]),
            "--json", str(work / "transports.json"), *(["--cpu"] if args.dry_run else [])]  # fmt: skip
    steps.append(Step("transports", argv, limits["transports"], work / "transports.json"))
    outcomes = runner.run_all(steps)
    tests, transports = outcomes["cuda_tests"], outcomes["transports"]
    tests["result"] = junit_counts(junit)
    counts = tests["result"]
    if not args.dry_run and tests["status"] == "passed" and counts.get("tests") == counts.get("skipped"):
        tests["status"] = "failed (every test skipped on a CUDA machine)"
    nccl = transports.get("result", {}).get("collective", {})
    if args.dry_run:
        reason = "a dry run has no CUDA device; the same collective code ran over Gloo (transports: collective)"
        runner.summary["nccl"] = {"status": "not run", "reason": reason}
    elif nccl.get("status") == "not run":
        runner.summary["nccl"] = {"status": "not run", "reason": nccl["reason"]}
    else:
        runner.summary["nccl"] = {"status": nccl.get("status", transports["status"]), "via": nccl.get("via")}
    runner.save()


def headline(summary: dict) -> dict:
    """The figures a reader wants first, from the steps' results."""
    steps, out = summary["steps"], {}
    decode = steps.get("decode", {}).get("result", {}).get("rows", [])
    for r in decode:
        if r["engine"] == "tandem eager":
            out[f"decode {r['model']} ctx {r['context']} batch {r['batch']} roofline"] = round(r["roofline_frac"], 3)
    for r in steps.get("prefill", {}).get("result", {}).get("rows", []):
        out[f"prefill {r['model']} {r['prompt_tokens']} tokens MFU"] = round(r["mfu"], 3)
    for r in steps.get("kv_overlap", {}).get("result", {}).get("rows", []):
        for mode, share in r["hidden"].items():
            out[f"kv {r['prompt_tokens']} tokens hidden ({mode})"] = round(share, 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder for gpu_check.json and the plots")
    parser.add_argument("--dry-run", action="store_true", help="every step on the CPU with tiny shapes")
    parser.add_argument("--real-model", default=None, help=f"the real model's folder (default: {REAL} in .cache)")
    parser.add_argument(
        "--budget-s", type=float, default=None,
        help=f"seconds for all the steps together (default: {BUDGET_S}, a dry run {DRY_SLACK} times as long)",
    )  # fmt: skip
    args = parser.parse_args()
    budget_s = args.budget_s or BUDGET_S * (DRY_SLACK if args.dry_run else 1)
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"dry_run": args.dry_run, "started": datetime.now(UTC).isoformat(timespec="seconds"),
                     "environment": environment(args.dry_run), "steps": {}}  # fmt: skip
    runner = Runner(summary, out / "gpu_check.json", budget_s, jobs=DRY_JOBS if args.dry_run else 1)
    print(json.dumps(summary["environment"], indent=2), flush=True)
    if not args.dry_run and not summary["environment"]["cuda_available"]:
        summary["status"] = "failed: no CUDA device"
        runner.save()
        return 1
    work = Path(tempfile.mkdtemp(prefix="tandem-gpu-check-"))
    try:
        source = dry_real_source(work) if args.dry_run else Path(args.real_model or _first_real())
        models = random_models(work, args.dry_run)
        models["real"], weights = real_model(source, work)
        summary["models"] = {"random": {"preset": "tiny" if args.dry_run else "llama-1b", "weights": "random"},
                             "real": {"name": REAL, "source": str(source), "weights": weights}}  # fmt: skip
        run_steps(runner, args, work, models)
    except Exception as e:  # the models could not be prepared: say so in the summary, not only in the log
        summary["status"] = f"failed: {e!r}"
        runner.save()
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary["headline"] = headline(summary)
    summary["plots"] = plot(summary, out)
    failed = [name for name, step in summary["steps"].items() if step["status"] != "passed"]
    summary["status"] = "passed" if not failed else f"failed: {', '.join(failed)}"
    summary["wall_s"] = round(time.monotonic() - started, 1)
    runner.save()
    print(f"\n{json.dumps(summary['headline'], indent=2)}\nnccl: {summary.get('nccl')}")
    print(f"gpu check {summary['status']} in {summary['wall_s']:.0f} s; wrote {out / 'gpu_check.json'}")
    return 0 if not failed else 1


def _finite(value: object) -> object:
    """`value` with every NaN or infinity as None: JSON has no such numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _first_real() -> Path:
    for source in REAL_SOURCES:
        if (source / "config.json").exists():
            return source
    raise SystemExit(f"no {REAL} config.json in {' or '.join(map(str, REAL_SOURCES))}: run scripts/gpu_wheels.sh")


def plot(summary: dict, out: Path) -> list[str]:
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    from gpu_plots import plot_decode, plot_overlap, plot_prefill

    written = []
    for name, draw in (("decode", plot_decode), ("prefill", plot_prefill), ("kv_overlap", plot_overlap)):
        result = summary["steps"].get(name, {}).get("result")
        if result:
            path = out / f"gpu_{name}.png"
            draw(result, summary, path)
            written.append(path.name)
    return written


if __name__ == "__main__":
    sys.path.insert(0, str(BENCH))
    sys.exit(main())
