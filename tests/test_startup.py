"""Where a start's time goes (`cluster.startup`): phases noted in each process, handed to the one
that started it, printed and read back; an engine core's start ships its own phases with its hello,
and does not run its parent's main script again."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cluster import startup
from cluster.engine import core_process
from cluster.startup import Phase

ROOT = Path(__file__).resolve().parents[1]


def test_the_printed_phases_read_back_as_they_were_and_other_lines_are_passed_over():
    core = Phase("engine core", 6.5, [Phase("process start, imports", 3.6), Phase("model", 2.0)])
    phases = [
        Phase("Ray", 9.03),
        Phase("pools", 13.1, [Phase("decode-0", 11.7, [Phase("imports", 3.4), core]), Phase("prefill-0", 11.4)]),
        Phase("router", 0.32),
    ]
    text = ["starting Ray ...", "ready in 23.08 s:", *startup.lines(phases), "user: hello: 2 s"]
    assert text[2:4] == ["  Ray: 9.03 s", "  pools: 13.10 s"] and text[6] == "      engine core: 6.50 s"
    assert startup.parse(text) == phases


def test_a_phase_is_noted_when_its_block_raises_and_taken_forgets_what_it_hands_on():
    startup.taken()
    with pytest.raises(ValueError), startup.phase("a failing load"):
        raise ValueError("bad weights")
    [failed] = startup.taken()
    assert failed.name == "a failing load" and failed.seconds >= 0
    assert startup.taken() == []


def test_with_rest_puts_first_what_the_parts_leave_of_the_whole():
    whole = startup.with_rest("engine core", 5.0, [Phase("model", 1.5), Phase("engine", 0.5)], "process start")
    assert [(p.name, p.seconds) for p in whole.parts] == [("process start", 3.0), ("model", 1.5), ("engine", 0.5)]
    assert startup.with_rest("x", 1.0, [Phase("y", 2.0)], "rest").parts[0].seconds == 0.0, "clocks disagree: none"


def hello_core(commands, events, config_json: str) -> None:  # type: ignore[no-untyped-def]
    """A core's entry that builds nothing: it notes a phase and says hello."""
    with startup.phase("model"):
        pass
    core_process.say_hello(events, "ready")


def test_a_core_sends_its_phases_with_its_hello_and_never_runs_its_parents_script_again(tmp_path):
    # A spawned process runs its parent's main script again unless it is told of none: this script
    # marks when it does (as `__mp_main__`), as a Ray worker's script would import all of Ray.
    marker = tmp_path / "ran-again"
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(f"""
        import os
        from pathlib import Path

        if __name__ == "__mp_main__":
            Path(os.environ["MARKER"]).write_text("the parent's script ran in the core")
        if __name__ == "__main__":
            from cluster import startup
            from cluster.config import parse_config
            from cluster.engine import core_process
            from tests.test_startup import hello_core

            config = parse_config({{"model": {{"path": {str(ROOT / "models" / "tandem-demo-code")!r}}}}})
            process, _, _, hello, _ = core_process.spawn(hello_core, config, "core", timeout_s=120)
            process.join(30)
            print("\\n".join([hello, *startup.lines(startup.taken())]))
        """)
    )
    env = {**os.environ, "MARKER": str(marker), "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'proto'}"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ready")
    [core] = startup.parse(result.stdout.splitlines())
    assert core.name == "engine core" and [p.name for p in core.parts] == ["process start, imports", "model"]
    assert sum(p.seconds for p in core.parts) == pytest.approx(core.seconds, abs=0.02)
    assert not marker.exists(), marker.read_text()


FRONT_MARK = None  # set by a front before its core starts: a forked core sees it, a spawned one does not
TITLE = None  # set in a forked core by its front's `retitle`


def marked_core(commands, events, config_json: str) -> None:  # type: ignore[no-untyped-def]
    with startup.phase("model"):
        pass
    core_process.say_hello(events, f"{FRONT_MARK}, {TITLE}")


def test_the_next_core_of_a_front_that_has_only_imported_forks_from_it_and_later_ones_are_spawned():
    # A served worker says so before building its core (`fork_next_core`), and its core then starts
    # with every module imported; the phases the front noted stay the front's.
    script = textwrap.dedent(f"""
        from cluster import startup
        from cluster.config import parse_config
        from cluster.engine import core_process
        import tests.test_startup as t

        t.FRONT_MARK = "the front's"
        with startup.phase("front's imports"):
            pass
        config = parse_config({{"model": {{"path": {str(ROOT / "models" / "tandem-demo-code")!r}}}}})
        core_process.fork_next_core(lambda title: setattr(t, "TITLE", title))
        marks = []
        for _ in range(2):
            process, _, _, mark, _ = core_process.spawn(t.marked_core, config, "core", timeout_s=120)
            process.join(30)
            marks.append(mark)
        print(*marks, sep="\\n")
        print("\\n".join(startup.lines(startup.taken())))
        """)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'proto'}"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode == 0, result.stderr
    forked, spawned, *lines = result.stdout.splitlines()
    assert (forked, spawned) == ("the front's, tandem::core", "None, None")
    front, first, second = startup.parse(lines)
    assert front.name == "front's imports"
    for core in (first, second):  # each core's own phases only
        assert core.name == "engine core" and [p.name for p in core.parts] == ["process start, imports", "model"]


def waiting_core(commands, events, config_json: str) -> None:  # type: ignore[no-untyped-def]
    """A core that waits on its commands until its front is gone."""
    core_process.say_hello(events, str(os.getpid()))
    with contextlib.suppress(EOFError):
        commands.recv()


def test_a_forked_core_exits_when_its_front_is_killed():
    # A forked core holds copies of every descriptor its front had: the front's ends of their pipes
    # among them, which it must close, or it would never read the end of its commands.
    script = textwrap.dedent(f"""
        import os, signal
        from cluster.config import parse_config
        from cluster.engine import core_process
        import tests.test_startup as t

        config = parse_config({{"model": {{"path": {str(ROOT / "models" / "tandem-demo-code")!r}}}}})
        core_process.fork_next_core()
        _, _, _, pid, _ = core_process.spawn(t.waiting_core, config, "core", timeout_s=120)
        print(pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'proto'}"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode == -signal.SIGKILL, result.stderr
    core = Path(f"/proc/{int(result.stdout)}/status")
    deadline = time.monotonic() + 30
    while core.exists() and "\nState:\tZ" not in core.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not core.exists() or "\nState:\tZ" in core.read_text(), "the core outlived its front"
