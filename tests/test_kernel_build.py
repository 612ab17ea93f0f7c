"""The CPU kernels' build: found built by every later start, named by what it is made of, and never
waited on once its builder is dead (`cluster.model.kernel_build`)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cluster.model import kernel_build

ROOT = Path(__file__).resolve().parents[1]


def started(command: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", command],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group: killing it kills its compiler too
    )


def killed(process: subprocess.Popen[str]) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def test_a_waiter_names_the_lock_s_owner_and_takes_it_at_once_when_the_owner_is_killed(tmp_path, caplog):
    lock = tmp_path / "build.lock"
    owner = started(
        "import time\nfrom cluster.model.kernel_build import held\n"
        f"with held({str(lock)!r}, 'a build'):\n    print('held', flush=True)\n    time.sleep(600)"
    )
    try:
        assert owner.stdout.readline().strip() == "held"
        taken = threading.Event()

        def wait() -> None:
            with kernel_build.held(lock, "the test's build", say_every_s=0.2):
                taken.set()

        caplog.set_level(logging.WARNING, logger=kernel_build.__name__)
        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        deadline = time.monotonic() + 30
        while "waiting" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"held by pid {owner.pid}" in caplog.text, caplog.text
        assert not taken.is_set()
    finally:
        killed(owner)
    waiter.join(timeout=30)
    assert taken.is_set(), "the lock of a dead owner was not taken"
    assert "took over the test's build" in caplog.text


def test_a_start_killed_in_the_middle_of_its_build_leaves_nothing_and_the_next_proceeds_at_once(
    tmp_path, monkeypatch, caplog
):
    """A real build (the plain loops) killed while its compiler runs: the next start neither waits on
    its lock nor finds a library it half wrote, and builds in a staging folder of its own."""
    env = {"TANDEM_KERNELS_DIR": str(tmp_path)}
    builder = started("from cluster.model.kernel_build import main; main(['portable'])", env)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("portable-*.staging-*/build.ninja")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(tmp_path.glob("portable-*.staging-*/build.ninja")), "the build never started compiling"
    finally:
        killed(builder)
    monkeypatch.setenv("TANDEM_KERNELS_DIR", str(tmp_path))
    library = kernel_build.library("portable")
    assert not library.exists()

    def compile_library(variant: str, into: Path) -> None:  # stands in for the compiler's minute
        (into / library.name).write_bytes(b"built")

    monkeypatch.setattr(kernel_build, "compile_library", compile_library)
    caplog.set_level(logging.WARNING, logger=kernel_build.__name__)
    assert kernel_build.built("portable") == library and library.read_bytes() == b"built"
    assert "waiting" not in caplog.text, caplog.text
    assert not list(tmp_path.glob("*.staging-*")), "the killed build's staging folder was left"


def test_a_build_is_found_by_later_starts_and_named_by_its_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_KERNELS_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(kernel_build, "compile_library", lambda v, into: calls.append(v) or (into / "x.so").touch())
    monkeypatch.setattr(kernel_build, "library_name", lambda variant: "x")
    first = kernel_build.built("portable")
    assert kernel_build.built("portable") == first and calls == ["portable"], "a built library was built again"

    copy = tmp_path / "csrc"
    shutil.copytree(kernel_build.CSRC, copy)
    assert kernel_build.build_key("portable", copy) == kernel_build.build_key("portable"), "another checkout"
    assert kernel_build.build_key("avx2", copy) != kernel_build.build_key("portable", copy), "other flags"
    with (copy / "vec.h").open("a") as source:
        source.write("\n// changed\n")
    assert kernel_build.build_key("portable", copy) != kernel_build.build_key("portable"), "other sources"


def test_only_the_newest_builds_are_kept(tmp_path):
    builds = []
    for i in range(kernel_build.KEPT + 2):
        build = tmp_path / f"avx2-{i:016x}"
        build.mkdir()
        os.utime(build, (1000 + i, 1000 + i))
        builds.append(build)
    (tmp_path / "avx2-0000000000000009.staging-abc").mkdir()  # being built: never pruned
    (tmp_path / "portable-0000000000000000").mkdir()  # another variant's
    kernel_build.prune("avx2", keep=builds[0])
    left = sorted(p.name for p in tmp_path.iterdir())
    kept = [builds[0], *builds[-kernel_build.KEPT :]]
    assert left == sorted([*(b.name for b in kept), "avx2-0000000000000009.staging-abc", "portable-0000000000000000"])


def test_the_command_line_refuses_a_variant_this_cpu_cannot_run(monkeypatch):
    from cluster import cpu

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    with pytest.raises(SystemExit, match="does not run the avx512 kernels"):
        kernel_build.main(["avx512"])


@pytest.mark.slow
def test_every_variant_builds_here_and_one_this_cpu_cannot_run_is_never_loaded(tmp_path):
    """A variant for other machines (an image's, built for nodes of every kind): compiled here without
    loading it, which on this CPU would die of an illegal instruction."""
    foreign = [name for name in kernel_build.VARIANTS if name not in kernel_build.supported()]
    if not foreign:
        pytest.skip("this CPU runs every variant: none is built for other machines only")
    command = f"from cluster.model.kernel_build import built; print(built({foreign[-1]!r}))"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TANDEM_KERNELS_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", command], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    library = Path(done.stdout.strip())
    assert library.parent.parent == tmp_path and library.name == f"tandem_cpu_kernels_{foreign[-1]}.so"
    assert library.stat().st_size > 100_000


def test_every_builds_the_variants_this_cpu_cannot_run_too(monkeypatch):
    from cluster import cpu

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    asked = []
    monkeypatch.setattr(kernel_build, "built", lambda name: asked.append(name) or Path(f"/{name}.so"))
    kernel_build.main(["every"])
    assert asked == [*kernel_build.VARIANTS, "portable"]


@pytest.mark.slow
def test_a_wheel_carries_the_kernels_and_an_installed_process_finds_them_built(tmp_path):
    """`pip wheel` of the repo (`build_hooks.py`) carries this CPU's kernels; a process of the wheel,
    installed apart from the checkout, loads them without building anything."""
    variant = kernel_build.variant()
    if variant is None:
        pytest.skip("TANDEM_CPU_KERNELS=0: no kernels to carry")
    env = dict(os.environ, TANDEM_WHEEL_KERNELS=f"{variant} portable")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run([*pip, "wheel", "--no-build-isolation", "--no-deps", "-w", tmp_path, ROOT], env=env, check=True)
    (wheel,) = tmp_path.glob("tandem_serve-*.whl")
    assert "-linux_" in wheel.name  # a platform's wheel: it carries native code
    site, builds = tmp_path / "site", tmp_path / "builds"
    subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", site, wheel], check=True)
    probe = (
        "import cluster.model.cpu_kernels as k, cluster.model.kernel_build as b\n"
        f"print(k.__file__, b.library({variant!r}), k.available(), sep='\\n')"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(site), TANDEM_KERNELS_DIR=str(builds), TANDEM_CPU_KERNELS=variant),
        capture_output=True,
        text=True,
        check=True,
    )
    module, library, available = done.stdout.split()
    assert Path(module).is_relative_to(site)  # the installed copy, not the checkout's
    assert Path(library).is_relative_to(site / "cluster" / "model" / "kernels")
    assert available == "True"
    assert "building" not in done.stderr, done.stderr
    assert not builds.exists() or not any(builds.iterdir())  # nothing built beside it
