"""A machine's costs for one model, dtype and transport: what the simulator charges instead of a model.

A profile is a JSON file (`tandem profile` writes it, `load` reads it back and checks every field):

    {"version": 1, "model": ..., "dtype": ..., "machine": ..., "block_size": 16,
     "kv_bytes_per_token": 18432,
     "costs": {"1": STEP, "2": STEP},           # per torch thread count of a worker
     "transfer": {"grpc": {"base_s": .., "byte_s": ..}, ...},
     "router": {"request_s": .., "token_s": ..},
     "points": {...}}                            # the raw measurements the fits came from

    STEP = {"prefill": {"base_s", "token_s", "attn_s"},
            "decode": {"base_s", "row_s", "ctx_s"},
            "decode_compiled": {"base_s", "row_s", "ctx_s", "buckets": [1, 2, 4, ...]} or null}

One forward pass over a plan costs, in seconds,

    base + sum over prompt chunks of (token_s * n + attn_s * n * (start + n / 2))
         + sum over decode rows of (row_s + ctx_s * context)

where `base` is the larger base of the kinds present. A step of decode rows alone, with compiled
buckets, runs in the smallest bucket that holds its rows and pays for the bucket's rows.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

VERSION = 1


class ProfileError(ValueError):
    """A profile file that is missing, unreadable or malformed."""


@dataclass(frozen=True)
class PrefillCost:
    base_s: float
    token_s: float
    attn_s: float = 0.0

    def chunk_s(self, n: int, start: int) -> float:
        return self.token_s * n + self.attn_s * n * (start + n / 2)


@dataclass(frozen=True)
class DecodeCost:
    base_s: float
    row_s: float
    ctx_s: float = 0.0
    buckets: tuple[int, ...] = ()  # compiled graphs' row counts; empty: eager

    def rows_s(self, rows: int, context: int) -> float:
        """The decode part of a step of `rows` rows reading `context` cached tokens in all."""
        if self.buckets and rows <= self.buckets[-1]:
            rows = self.buckets[bisect.bisect_left(self.buckets, rows)]
        return self.row_s * rows + self.ctx_s * context


@dataclass(frozen=True)
class StepCosts:
    prefill: PrefillCost
    decode: DecodeCost
    decode_compiled: DecodeCost | None = None

    def step_s(self, prefill_s: float, rows: int, context: int, compiled: bool = False) -> float:
        """A pass's time from its prompt chunks' summed `chunk_s` and its decode rows."""
        decode = self.decode_compiled if compiled and self.decode_compiled and prefill_s == 0 else self.decode
        if decode.buckets and rows > decode.buckets[-1]:
            decode = self.decode  # more rows than the largest graph: eager
        base = max(self.prefill.base_s if prefill_s else 0.0, decode.base_s if rows else 0.0)
        return base + prefill_s + (decode.rows_s(rows, context) if rows else 0.0)


@dataclass(frozen=True)
class LinearCost:
    base_s: float
    per_s: float  # per byte (transfer) or per token (router)

    def at(self, amount: float) -> float:
        return self.base_s + self.per_s * amount


@dataclass(frozen=True)
class Profile:
    costs: dict[int, StepCosts]
    transfer: dict[str, LinearCost]
    router: LinearCost  # per request, per output token
    kv_bytes_per_token: int
    block_size: int = 16
    model: str = "unknown"
    dtype: str = "unknown"
    machine: str = "unknown"
    points: dict[str, Any] = field(default_factory=dict)
    tiers: dict[str, LinearCost] = field(default_factory=dict)  # a load of n bytes from each KV tier

    def tier_load_s(self, tier: str, num_blocks: int) -> float:
        """What loading `num_blocks` blocks from a KV tier takes (`cache.tiers` as profiled)."""
        if tier not in self.tiers:
            raise ProfileError(f"the profile has no costs for KV tier {tier!r}; it has {sorted(self.tiers)}")
        return self.tiers[tier].at(num_blocks * self.block_size * self.kv_bytes_per_token)

    def step_costs(self, threads: int) -> StepCosts:
        if threads not in self.costs:
            raise ProfileError(f"the profile has no costs for {threads} thread(s); it has {sorted(self.costs)}")
        return self.costs[threads]

    def transfer_s(self, transport: str, num_tokens: int) -> float:
        if transport not in self.transfer:
            raise ProfileError(f"the profile has no costs for transport {transport!r}; it has {sorted(self.transfer)}")
        return self.transfer[transport].at(num_tokens * self.kv_bytes_per_token)


def to_json(profile: Profile) -> dict[str, Any]:
    def step(s: StepCosts) -> dict[str, Any]:
        out: dict[str, Any] = {"prefill": asdict(s.prefill), "decode": _decode_json(s.decode)}
        out["decode_compiled"] = _decode_json(s.decode_compiled) if s.decode_compiled else None
        return out

    return {
        "version": VERSION,
        "model": profile.model,
        "dtype": profile.dtype,
        "machine": profile.machine,
        "block_size": profile.block_size,
        "kv_bytes_per_token": profile.kv_bytes_per_token,
        "costs": {str(k): step(v) for k, v in sorted(profile.costs.items())},
        "transfer": {k: {"base_s": v.base_s, "byte_s": v.per_s} for k, v in profile.transfer.items()},
        "router": {"request_s": profile.router.base_s, "token_s": profile.router.per_s},
        "tiers": {k: {"base_s": v.base_s, "byte_s": v.per_s} for k, v in profile.tiers.items()},
        "points": profile.points,
    }


def _decode_json(d: DecodeCost) -> dict[str, Any]:
    out: dict[str, Any] = {"base_s": d.base_s, "row_s": d.row_s, "ctx_s": d.ctx_s}
    if d.buckets:
        out["buckets"] = list(d.buckets)
    return out


def from_json(data: Any, source: str = "profile") -> Profile:
    """Checks and builds a profile; a wrong or missing field raises ProfileError naming it."""
    try:
        if not isinstance(data, dict):
            raise ProfileError("expected a JSON object")
        if data.get("version") != VERSION:
            raise ProfileError(f"version is {data.get('version')!r}, this Tandem reads version {VERSION}")
        costs = {int(k): _step(v, f"costs.{k}") for k, v in _get(data, "costs", dict).items()}
        if not costs:
            raise ProfileError("costs is empty")
        transfer = {
            k: LinearCost(_num(v, "base_s", f"transfer.{k}"), _num(v, "byte_s", f"transfer.{k}"))
            for k, v in _get(data, "transfer", dict).items()
        }
        router = _get(data, "router", dict)
        tiers = {
            k: LinearCost(_num(v, "base_s", f"tiers.{k}"), _num(v, "byte_s", f"tiers.{k}"))
            for k, v in (data.get("tiers") or {}).items()
        }
        return Profile(
            costs=costs,
            transfer=transfer,
            router=LinearCost(_num(router, "request_s", "router"), _num(router, "token_s", "router")),
            kv_bytes_per_token=int(_num(data, "kv_bytes_per_token", "")),
            block_size=int(_num(data, "block_size", "")),
            model=str(data.get("model", "unknown")),
            dtype=str(data.get("dtype", "unknown")),
            machine=str(data.get("machine", "unknown")),
            points=dict(data.get("points") or {}),
            tiers=tiers,
        )
    except ProfileError as e:
        raise ProfileError(f"{source}: {e}") from None


def _step(data: Any, where: str) -> StepCosts:
    if not isinstance(data, dict):
        raise ProfileError(f"{where} must be an object")
    p = _get(data, "prefill", dict, where)
    prefill = PrefillCost(_num(p, "base_s", where), _num(p, "token_s", where), _num(p, "attn_s", where, 0.0))
    compiled = data.get("decode_compiled")
    return StepCosts(
        prefill, _decode(_get(data, "decode", dict, where), where), _decode(compiled, where) if compiled else None
    )


def _decode(d: dict, where: str) -> DecodeCost:
    buckets = tuple(sorted(int(b) for b in d.get("buckets", ())))
    if any(b < 1 for b in buckets):
        raise ProfileError(f"{where}: buckets must be positive")
    return DecodeCost(_num(d, "base_s", where), _num(d, "row_s", where), _num(d, "ctx_s", where, 0.0), buckets)


def _get(data: dict, key: str, kind: type, where: str = "") -> Any:
    value = data.get(key)
    if not isinstance(value, kind):
        raise ProfileError(
            f"{where + '.' if where else ''}{key} is missing or not a{'n object' if kind is dict else ''}"
        )
    return value


def _num(data: dict, key: str, where: str, default: float | None = None) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ProfileError(f"{where + '.' if where else ''}{key} must be a non-negative number, not {value!r}")
    return float(value)


def load(path: str | Path) -> Profile:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ProfileError(f"cannot read profile {path}: {e.strerror} (write one with `tandem profile`)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path} is not valid JSON: {e}") from None
    return from_json(data, str(path))


def save(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_json(profile), indent=1) + "\n")


def fit_linear(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative least squares, small and exact enough: ordinary least squares by the normal
    equations, then any negative coefficient dropped (held at 0) and the rest refitted."""
    active = list(range(len(rows[0])))
    while True:
        coef = _lstsq([[r[j] for j in active] for r in rows], ys)
        if all(c >= 0 for c in coef) or len(active) == 1:
            out = [0.0] * len(rows[0])
            for j, c in zip(active, coef, strict=True):
                out[j] = max(c, 0.0)
            return out
        active.pop(min(range(len(coef)), key=lambda i: coef[i]))


def _lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    k = len(rows[0])
    a = [
        [sum(r[i] * r[j] for r in rows) for j in range(k)] + [sum(r[i] * y for r, y in zip(rows, ys, strict=True))]
        for i in range(k)
    ]
    for col in range(k):  # Gauss-Jordan with partial pivoting
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-300:
            continue
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][k] / a[i][i] if abs(a[i][i]) > 1e-300 else 0.0 for i in range(k)]
