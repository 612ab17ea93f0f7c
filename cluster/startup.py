"""Where a start's time goes, as each process of the start saw it.

A process notes its phases as it goes (`phase`, `note`); whoever started it takes them (`taken`)
and files them under a phase of its own: an engine core's model load and warm-up under its worker's
"engine core", each worker under the pools' start, as `tandem serve --verbose` prints them
(`lines`). A phase noted from outside the process it times (a process's start, seen by its parent)
is the difference of wall clocks on one machine.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Phase:
    name: str
    seconds: float
    parts: list[Phase] = field(default_factory=list)  # what it was made of, in order


_noted: list[Phase] = []  # this process's phases since the last `taken`


def note(p: Phase) -> None:
    _noted.append(p)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Notes how long the block took (also when it raised: a failed start says where it spent its time)."""
    began = time.perf_counter()
    try:
        yield
    finally:
        note(Phase(name, time.perf_counter() - began))


def taken() -> list[Phase]:
    """The phases noted in this process since the last call, forgotten here."""
    phases = _noted[:]
    _noted.clear()
    return phases


def with_rest(name: str, seconds: float, parts: list[Phase], rest: str) -> Phase:
    """`name`, which took `seconds` as a whole, made of `parts` and, first, what they leave (`rest`):
    the time no part accounts for, such as a process's start before it could note anything."""
    left = max(0.0, seconds - sum(p.seconds for p in parts))
    return Phase(name, seconds, [Phase(rest, left), *parts])


def lines(phases: Iterable[Phase], depth: int = 1) -> list[str]:
    """`name: 1.23 s` a phase, its parts indented beneath it."""
    out = []
    for p in phases:
        out.append(f"{'  ' * depth}{p.name}: {p.seconds:.2f} s")
        out.extend(lines(p.parts, depth + 1))
    return out


_LINE = re.compile(r"(?P<indent>(?:  )+)(?P<name>.+): (?P<seconds>[0-9.]+) s")


def parse(text: Iterable[str]) -> list[Phase]:
    """The phases `lines` wrote, from text that holds them (other lines are passed over)."""
    top: list[Phase] = []
    open_: list[Phase] = []  # the last phase seen at each depth
    for line in text:
        m = _LINE.fullmatch(line.rstrip())
        if m is None:
            continue
        depth = len(m["indent"]) // 2
        p = Phase(m["name"], float(m["seconds"]))
        if depth == 1:
            top.append(p)
        elif depth - 2 < len(open_):
            open_[depth - 2].parts.append(p)
        else:
            continue  # a part whose whole is not in the text
        del open_[depth - 1 :]
        open_.append(p)
    return top
