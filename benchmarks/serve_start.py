"""`tandem serve` from the command to ready, first run and warm, and where the time goes.

    .venv/bin/python benchmarks/serve_start.py [--warm 2] [--joined 2] [--models demo,smollm2]

For each model (the bundled demo model; SmolLM2-135M-Instruct as `make run` serves it), a first run
and `--warm` more, one after another: `tandem serve --verbose --prompt ...`, whose breakdown
(`cluster.startup`) the table shows beside the command's wall clock to ready (its own start, before
it reads its config, is the difference). Then `--joined` more per model that join a Ray head already
running (`ray_address`), as a cluster's Ray is: the start without Ray's own. The first run is on a
cold page cache where this process may drop it (root: `/proc/sys/vm/drop_caches`), as on a machine
that just booted: torch's libraries, the model's file and every module read from disk; else it is
only the first, and the table says so. The kernels are built by the set-up step, as `make run` and
`make test` build them, before any run.

Goals (issue: ready in seconds): ready within 10 s warm and 20 s on the first run. Prints a table
and writes `benchmarks/results/serve_start{suffix}.{json,png}` (`cluster.cpu.results_suffix`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "proto"))

from benchmarks.plots import Panel, bar_panels  # noqa: E402
from cluster import startup  # noqa: E402
from cluster.cpu import cpu_kind, results_suffix  # noqa: E402
from tests.net import free_port  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
TANDEM = str(Path(sys.executable).parent / "tandem")
MODELS = {  # name -> the arguments that serve it, and its prompt
    "demo": ([], "def add(a, b):"),
    "smollm2": (["--config", str(ROOT / "examples" / "smollm2.yaml"), "--chat"], "What is the capital of France?"),
}
GOALS = {"first": 20.0, "warm": 10.0}
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
# A Ray head started apart asks its token of every process that joins it, as `ray.init`'s own does
# (docs/operations.md): the head, `ray status` and the joining `tandem serve` all say so.
JOINING_ENV = {"RAY_AUTH_MODE": "token"}


def drop_page_cache() -> bool:
    """Empties the kernel's page cache where this process may; whether it did."""
    try:
        os.sync()
        DROP_CACHES.write_text("3\n")
        return True
    except OSError:
        return False


def serve_once(model: str, ray_address: str | None = None) -> dict:
    """One `tandem serve --verbose --prompt` to its end: the wall clock to the ready line, and the
    breakdown it printed. With `ray_address`, it joins that Ray rather than starting its own."""
    args, prompt = MODELS[model]
    if ray_address is not None:
        args = ["--config", str(joining(args, ray_address)), *args[2:]]
    command = [TANDEM, "serve", *args, "--port", "0", "--verbose", "--prompt", prompt, "--max-tokens", "4"]
    began = time.perf_counter()
    env = dict(os.environ, **(JOINING_ENV if ray_address is not None else {}))
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines, to_ready = [], None
    for line in process.stderr:  # type: ignore[union-attr]
        lines.append(line.rstrip("\n"))
        if to_ready is None and line.startswith("ready in "):
            to_ready = time.perf_counter() - began
    answer = process.stdout.read()  # type: ignore[union-attr]
    if process.wait() != 0 or to_ready is None:
        raise RuntimeError(f"{' '.join(command)} failed:\n" + "\n".join(lines[-20:]))
    ready = float(next(line for line in lines if line.startswith("ready in ")).split()[2])
    phases = startup.parse(lines)
    return {"to_ready_s": to_ready, "ready_s": ready, "command_start_s": to_ready - ready, "answer": answer.strip(),
            "phases": [_as_dict(p) for p in phases]}  # fmt: skip


def joining(args: list[str], ray_address: str) -> Path:
    """The model's config (`--config` in `args`, or the defaults' demo model) with `ray_address` set."""
    demo = {"model": {"path": str(ROOT / "models" / "tandem-demo-code")}}
    config = yaml.safe_load(Path(args[1]).read_text()) if args[:1] == ["--config"] else demo
    path = Path(tempfile.gettempdir()) / f"serve_start_{os.getpid()}.yaml"
    path.write_text(yaml.safe_dump({**config, "ray_address": ray_address}))
    return path


@contextlib.contextmanager
def ray_head(cores: int) -> Iterator[str]:
    """A Ray head of its own (`ray start --head --block`, dashboard and all), stopped with its
    processes when done (never `ray stop`: it would stop every Ray on the machine). Its folder is
    its own too: `ray start` names its head there for a later `ray.init()` to join, and only `ray
    stop` would remove that name from Ray's shared folder."""
    port = free_port()
    ray = Path(sys.executable).parent / "ray"
    command = [str(ray), "start", "--head", "--block", f"--port={port}", f"--num-cpus={cores}", "--disable-usage-stats"]
    env = dict(os.environ, **JOINING_ENV)
    # The folder's path short (Ray's socket paths are bounded); its log read only if it fails (a pipe
    # left unread could stall it).
    with tempfile.TemporaryDirectory(prefix="tss-", dir="/tmp") as folder, tempfile.TemporaryFile("w+") as log:
        command.append(f"--temp-dir={folder}")
        head = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        address = f"127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            status = [str(ray), "status", f"--address={address}"]
            while subprocess.run(status, capture_output=True, env=env).returncode != 0:
                if head.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"the Ray head did not start:\n{log.read()[-2000:]}")
                time.sleep(1)
            yield address
        finally:
            head.terminate()  # `--block`: it stops the processes it started
            try:
                head.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(head.pid, signal.SIGKILL)
                head.wait()


def median(runs: Iterable[dict]) -> float | None:
    """The runs' median time to ready; None for none."""
    times = [r["to_ready_s"] for r in runs]
    return statistics.median(times) if times else None


def _as_dict(p: startup.Phase) -> dict:
    return {"name": p.name, "seconds": p.seconds, "parts": [_as_dict(q) for q in p.parts]}


def flat(phases: list[dict], prefix: str = "") -> dict[str, float]:
    """'pools / decode-0 / engine core / model' -> seconds, every phase at every depth."""
    out = {}
    for p in phases:
        name = f"{prefix}{p['name']}"
        out[name] = p["seconds"]
        out.update(flat(p["parts"], f"{name} / "))
    return out


def table(runs: list[dict]) -> list[str]:
    heads = [f"{r['model']} {r['run']}" for r in runs]
    rows: dict[str, list[float | None]] = {}
    for i, r in enumerate(runs):
        values = {
            "to ready, the command's wall clock": r["to_ready_s"],
            "the command's own start": r["command_start_s"],
        }
        values.update(flat(r["phases"]))
        for name, seconds in values.items():
            rows.setdefault(name, [None] * len(runs))[i] = seconds
    width = max(len(name) for name in rows)
    out = [f"{'s':<{width}} | " + " | ".join(f"{h:>14}" for h in heads)]
    for name, values in rows.items():
        cells = " | ".join(f"{'' if v is None else f'{v:.2f}':>14}" for v in values)
        out.append(f"{name:<{width}} | {cells}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm", type=int, default=2, help="warm runs per model after its first (default: 2)")
    parser.add_argument("--models", default="demo,smollm2", help="comma-separated: demo, smollm2")
    parser.add_argument(
        "--joined", type=int, default=2, help="warm runs per model that join a running Ray head (default: 2)"
    )
    args = parser.parse_args()
    subprocess.run([sys.executable, "-m", "cluster.model.kernel_build"], cwd=ROOT, check=True)
    runs = []
    for model in args.models.split(","):
        cold = drop_page_cache()
        runs.append({"model": model, "run": "first", "cold_page_cache": cold, **serve_once(model)})
        for i in range(args.warm):
            runs.append({"model": model, "run": f"warm {i + 1}", "cold_page_cache": False, **serve_once(model)})
    if args.joined:
        with ray_head(os.cpu_count() or 2) as address:
            for model in args.models.split(","):
                for i in range(args.joined):
                    run = {"model": model, "run": f"Ray up {i + 1}", "cold_page_cache": False}
                    runs.append({**run, **serve_once(model, address)})
    print(f"tandem serve to ready, s; {cpu_kind()} CPU, {os.cpu_count()} cores; first runs on a "
          f"{'cold' if all(r['cold_page_cache'] for r in runs if r['run'] == 'first') else 'warm (could not drop it)'} "
          "page cache")  # fmt: skip
    print("\n".join(table(runs)))
    verdicts = {}
    for model in args.models.split(","):
        first = next(r["to_ready_s"] for r in runs if r["model"] == model and r["run"] == "first")
        warm = median(r for r in runs if r["model"] == model and r["run"].startswith("warm"))
        joined = median(r for r in runs if r["model"] == model and r["run"].startswith("Ray up"))
        verdicts[model] = {"first_s": first, "warm_median_s": warm, "first_goal_met": first <= GOALS["first"],
                           "warm_goal_met": warm is not None and warm <= GOALS["warm"],
                           "ray_up_median_s": joined}  # fmt: skip
        said = [f"first {first:.1f} s (goal {GOALS['first']:g})"]
        said += [f"warm {warm:.1f} s (goal {GOALS['warm']:g})"] if warm is not None else []
        said += [f"joining a running Ray {joined:.1f} s"] if joined is not None else []
        print(f"{model}: {', '.join(said)}")
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"serve_start{results_suffix()}"
    meta = {"cpu": cpu_kind(), "cores": os.cpu_count(), "goals_s": GOALS}
    path.with_suffix(".json").write_text(json.dumps({**meta, "runs": runs, "verdicts": verdicts}, indent=1) + "\n")
    plot(runs, path.with_suffix(".png"))
    print(f"wrote {path}.json and .png")


def plot(runs: list[dict], path: Path) -> None:
    labels = [f"{r['model']}\n{r['run']}" for r in runs]
    parts = [flat(r["phases"]) for r in runs]
    pools = "pools"
    panels = [
        Panel([r["to_ready_s"] for r in runs], "s", "to ready (the command's wall clock)",
              marks=[GOALS["first" if r["run"] == "first" else "warm"] for r in runs], marks_label="goal"),
        Panel([p.get("Ray", 0.0) for p in parts], "s", "Ray", beside=[p.get(pools, 0.0) for p in parts],
              labels=("Ray", "pools")),
    ]  # fmt: skip
    bar_panels(path, labels, panels, f"tandem serve to ready ({cpu_kind()})")


if __name__ == "__main__":
    main()
