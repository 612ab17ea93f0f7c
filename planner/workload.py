"""Workloads: when requests arrive and how long their prompts and outputs are.

A workload is a JSON (or YAML) object, or the name of a preset:

    {"name": "short-chat",
     "arrival": {"process": "poisson", "rate": 4.0}          # or gamma (with "cv"), or
                                                             # {"process": "trace", "path": "t.jsonl"}
     "requests": 2000,                                       # how many to draw
     "classes": [{"weight": 1, "prompt": DIST, "output": DIST,
                  "prefix": {"groups": 8, "tokens": 512}}]}  # optional: prompts share a group's prefix

    DIST = {"dist": "fixed", "value": 128} | {"dist": "uniform", "low": 32, "high": 256}
         | {"dist": "lognormal", "median": 200, "sigma": 0.6, "low": 8, "high": 4096}

A trace has one JSON object a line: `{"arrival_s": 0.31, "prompt_tokens": 812, "output_tokens": 64}`
(optionally `"prefix_group"` and `"prefix_tokens"`). `arrivals(workload, seed)` yields requests in
arrival order, drawn lazily so a million of them cost no memory.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml


class WorkloadError(ValueError):
    """A workload that is missing, empty or malformed."""


@dataclass(frozen=True)
class Arrival:
    time: float
    prompt_tokens: int
    output_tokens: int
    prefix_group: int = -1  # -1: no shared prefix
    prefix_tokens: int = 0


@dataclass(frozen=True)
class Workload:
    name: str
    arrival: dict[str, Any]
    classes: tuple[dict[str, Any], ...]
    requests: int

    @property
    def rate(self) -> float | None:
        return self.arrival.get("rate")

    def with_rate(self, rate: float) -> Workload:
        if self.arrival["process"] == "trace":
            raise WorkloadError("a trace's arrival rate is the trace's own")
        return replace(self, arrival={**self.arrival, "rate": rate})

    def with_requests(self, n: int) -> Workload:
        return replace(self, requests=n)


def _chat(rate: float) -> dict:
    dist = {"dist": "lognormal", "median": 120, "sigma": 0.6, "low": 16, "high": 512}
    out = {"dist": "lognormal", "median": 48, "sigma": 0.5, "low": 8, "high": 128}
    return {"arrival": {"process": "poisson", "rate": rate}, "classes": [{"weight": 1, "prompt": dist, "output": out}]}


PRESETS: dict[str, dict[str, Any]] = {
    "short-chat": _chat(4.0),
    "rag": {
        "arrival": {"process": "poisson", "rate": 0.5},
        "classes": [{"weight": 1, "prompt": {"dist": "uniform", "low": 1500, "high": 3000},
                     "output": {"dist": "uniform", "low": 32, "high": 128}}],
    },
    "code": {
        "arrival": {"process": "poisson", "rate": 2.0},
        "classes": [{"weight": 1, "prompt": {"dist": "uniform", "low": 256, "high": 1024},
                     "output": {"dist": "uniform", "low": 8, "high": 32}, "prefix": {"groups": 16, "tokens": 512}}],
    },
    # benchmarks/disagg.py's mix, open loop: short prompts that decode long, long prompts that decode little
    "disagg": {
        "arrival": {"process": "poisson", "rate": 2.0},
        "classes": [
            {"weight": 3, "prompt": {"dist": "fixed", "value": 16}, "output": {"dist": "fixed", "value": 64}},
            {"weight": 1, "prompt": {"dist": "fixed", "value": 1024}, "output": {"dist": "fixed", "value": 4}},
        ],
    },
}  # fmt: skip


def parse(data: Any, source: str = "workload") -> Workload:
    if not isinstance(data, dict):
        raise WorkloadError(f"{source}: expected an object")
    arrival = data.get("arrival")
    if not isinstance(arrival, dict) or arrival.get("process") not in ("poisson", "gamma", "trace"):
        raise WorkloadError(f"{source}: arrival.process must be poisson, gamma or trace")
    if arrival["process"] == "trace":
        if not Path(str(arrival.get("path", ""))).is_file():
            raise WorkloadError(f"{source}: no trace file at {arrival.get('path')!r}")
    elif not _positive(arrival.get("rate")):
        raise WorkloadError(f"{source}: arrival.rate must be a positive number of requests per second")
    elif arrival["process"] == "gamma" and not _positive(arrival.get("cv")):
        raise WorkloadError(f"{source}: a gamma process needs a positive arrival.cv")
    classes = data.get("classes") or ()
    if arrival["process"] != "trace":
        if not classes:
            raise WorkloadError(f"{source}: the workload has no request classes (it is empty)")
        for i, c in enumerate(classes):
            if not _positive(c.get("weight", 1)):
                raise WorkloadError(f"{source}: classes[{i}].weight must be positive")
            for key in ("prompt", "output"):
                _check_dist(c.get(key), f"{source}: classes[{i}].{key}")
    requests = data.get("requests", 1000)
    if not isinstance(requests, int) or requests < 1:
        raise WorkloadError(f"{source}: requests must be a positive integer, not {requests!r} (the workload is empty)")
    return Workload(str(data.get("name", source)), dict(arrival), tuple(classes), requests)


def load(spec: str) -> Workload:
    """A preset's name, or a JSON / YAML file."""
    if spec in PRESETS:
        return parse({"name": spec, **PRESETS[spec]}, spec)
    path = Path(spec)
    if not path.is_file():
        raise WorkloadError(f"no workload {spec!r}: give a file or one of {', '.join(PRESETS)}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise WorkloadError(f"{path} is not valid JSON or YAML: {e}") from None
    if isinstance(data, dict):
        data.setdefault("name", path.stem)
    return parse(data, str(path))


def arrivals(workload: Workload, seed: int = 0) -> Iterator[Arrival]:
    if workload.arrival["process"] == "trace":
        yield from _trace(Path(workload.arrival["path"]), workload.requests)
        return
    rng = random.Random(seed)
    rate = float(workload.arrival["rate"])
    shape = 1 / float(workload.arrival["cv"]) ** 2 if workload.arrival["process"] == "gamma" else 1.0
    weights = [float(c.get("weight", 1)) for c in workload.classes]
    t = 0.0
    for _ in range(workload.requests):
        t += rng.gammavariate(shape, 1 / (rate * shape)) if shape != 1.0 else rng.expovariate(rate)
        c = workload.classes[rng.choices(range(len(weights)), weights)[0]] if len(weights) > 1 else workload.classes[0]
        prompt, output = _draw(c["prompt"], rng), _draw(c["output"], rng)
        prefix = c.get("prefix")
        if prefix:
            tokens = min(int(prefix["tokens"]), prompt - 1)
            yield Arrival(t, prompt, output, rng.randrange(int(prefix["groups"])), tokens)
        else:
            yield Arrival(t, prompt, output)


def _trace(path: Path, limit: int) -> Iterator[Arrival]:
    with path.open() as f:
        for n, line in enumerate(f):
            if n >= limit:
                return
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                yield Arrival(
                    float(row["arrival_s"]), int(row["prompt_tokens"]), int(row["output_tokens"]),
                    int(row.get("prefix_group", -1)), int(row.get("prefix_tokens", 0)),
                )  # fmt: skip
            except (KeyError, ValueError, TypeError) as e:
                raise WorkloadError(f"{path}:{n + 1}: not a trace row ({e})") from None


def _draw(dist: dict, rng: random.Random) -> int:
    kind = dist["dist"]
    if kind == "fixed":
        return int(dist["value"])
    if kind == "uniform":
        return rng.randint(int(dist["low"]), int(dist["high"]))
    value = round(float(dist["median"]) * math.exp(rng.gauss(0.0, float(dist["sigma"]))))
    return min(max(value, int(dist.get("low", 1))), int(dist.get("high", 10**9)))


def mean_lengths(workload: Workload, samples: int = 4000) -> tuple[float, float]:
    """Mean prompt and output tokens (by sampling the distributions)."""
    drawn = list(arrivals(workload.with_requests(samples), seed=12345))
    return sum(a.prompt_tokens for a in drawn) / len(drawn), sum(a.output_tokens for a in drawn) / len(drawn)


def _check_dist(dist: Any, where: str) -> None:
    if not isinstance(dist, dict) or dist.get("dist") not in ("fixed", "uniform", "lognormal"):
        raise WorkloadError(f"{where} must be a fixed, uniform or lognormal distribution")
    keys = {"fixed": ("value",), "uniform": ("low", "high"), "lognormal": ("median", "sigma")}[dist["dist"]]
    for key in keys:
        if not _positive(dist.get(key)):
            raise WorkloadError(f"{where}.{key} must be a positive number")
    if dist["dist"] == "uniform" and dist["low"] > dist["high"]:
        raise WorkloadError(f"{where}: low exceeds high")


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0
