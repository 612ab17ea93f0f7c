"""Builds the CPU kernels once per source version, and finds them built in every later process.

A build lives in a folder named by what it is made of: the instruction set and a key over every
source in `csrc/`, the compiler flags, torch's version and Python's (`build_key`), under
`TANDEM_KERNELS_DIR` (default `~/.cache/tandem/kernels`). Checkouts and processes with the same
sources share one build, and a checkout whose sources changed builds its own beside the others: a
start never rebuilds what another checkout built, nor loads a build of other sources.

The build runs in the install step (`python -m cluster.model.kernel_build`, which the Makefile's
`make run` and `make test` call; `... kernel_build every` in the image, for nodes of every kind:
a variant this CPU cannot run is compiled and never loaded here; a wheel built from the repo
carries them in `cluster/model/kernels/`, `build_hooks.py`), so a serving process finds the
kernels built; one that does not builds them itself and says so. One process builds a variant at
a time, under an exclusive lock on a file that records its owner; the kernel releases it when its
owner dies however it dies, so a build that was killed never stalls the next start, and a waiter
names whom it waits for, and for how long, until it has the lock. A build writes into a staging
folder of its own and renames it into place when done: a killed build leaves nothing another
process would load.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
PACKAGED = Path(__file__).parent / "kernels"  # the builds a wheel carries, found before `root()`'s
ROOT = Path(__file__).resolve().parents[2]  # where `cluster` imports from
SOURCE = CSRC / "kernels.cpp"  # includes every other source: one translation unit
KEPT = 4  # builds kept per variant (other checkouts may still use older sources)


_AVX512 = ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
# Instruction sets the kernels are built for, best first: the CPU flags each needs, and the compiler's.
# Every CPU with AVX512-BF16 has AVX512-VNNI (the quantised products' `vpdpbusd`).
VARIANTS = {
    "avx512_bf16": (
        {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"},
        [*_AVX512, "-mavx512bf16", "-mavx512vnni"],
    ),
    "avx512": ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, _AVX512),
    "avx2": ({"avx2", "fma", "f16c"}, ["-mavx2", "-mfma", "-mf16c"]),
}


def supported() -> list[str]:
    """The variants this CPU runs, best first."""
    from cluster.cpu import cpu_flags

    return [name for name, (needs, _) in VARIANTS.items() if needs <= cpu_flags()]


def variant() -> str | None:
    """The instruction set the kernels are built for here: `TANDEM_CPU_KERNELS` if it names one this
    CPU runs, else the best it runs; None for `TANDEM_CPU_KERNELS=0` or a CPU with none of them
    (their plain loops, which torch's kernels outrun, are kept for tests: "portable")."""
    chosen = os.environ.get("TANDEM_CPU_KERNELS", "auto")
    if chosen == "0":
        return None
    if chosen == "portable":
        return "portable"
    runs = supported()
    if chosen not in ("auto", *runs):
        known = ", ".join([*VARIANTS, "portable", "0"])
        raise ValueError(f"TANDEM_CPU_KERNELS={chosen!r}: this CPU runs {runs or 'none of them'} (known: {known})")
    return chosen if chosen != "auto" else (runs[0] if runs else "portable")


def root() -> Path:
    """Where builds live: `TANDEM_KERNELS_DIR`, else `~/.cache/tandem/kernels`."""
    chosen = os.environ.get("TANDEM_KERNELS_DIR")
    return Path(chosen) if chosen else Path.home() / ".cache" / "tandem" / "kernels"


def library_name(variant: str) -> str:
    return f"tandem_cpu_kernels_{variant}"


def cflags(variant: str) -> list[str]:
    return ["-O3", "-mtune=native", *(VARIANTS[variant][1] if variant in VARIANTS else []), "-fopenmp"]


def build_key(variant: str, csrc: Path = CSRC) -> str:
    """A digest of everything the library is made of: every source, the flags, torch and Python."""
    import torch

    digest = hashlib.sha256()
    for path in sorted(p for p in csrc.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for part in (*cflags(variant), torch.__version__, sys.version, sys.platform):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def library(variant: str) -> Path:
    """Where this checkout's build of `variant` is, built or not: the one the installed wheel
    carries for these sources, torch and Python, else the one under `root()`."""
    name = Path(f"{variant}-{build_key(variant)}") / f"{library_name(variant)}.so"
    return PACKAGED / name if (PACKAGED / name).exists() else root() / name


def built(variant: str) -> Path:
    """This checkout's build of `variant`, built now (under the lock) if no process has built it."""
    path = library(variant)
    if path.exists():
        return path
    folder = path.parent
    folder.parent.mkdir(parents=True, exist_ok=True)
    with held(folder.with_suffix(".lock"), f"the build of the CPU kernels for {variant}"):
        if path.exists():  # built by the process we waited for
            return path
        for left in folder.parent.glob(f"{folder.name}.staging-*"):  # a killed build's: its owner is gone
            shutil.rmtree(left, ignore_errors=True)
        log.warning("building the CPU kernels for %s (once per source version; about a minute) ...", variant)
        started = time.monotonic()
        staging = Path(tempfile.mkdtemp(prefix=f"{folder.name}.staging-", dir=folder.parent))
        try:
            compile_library(variant, staging)
            staging.chmod(0o755)  # mkdtemp's folder is its owner's alone
            os.rename(staging, folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.warning("built the CPU kernels for %s in %.0f s: %s", variant, time.monotonic() - started, path)
    prune(variant, keep=folder)
    return path


def compile_library(variant: str, into: Path) -> None:
    """Compiles `variant`'s library in folder `into`, in a process of its own: torch's builder loads
    what it builds, and a process holds one variant's kernels only."""
    command = [
        sys.executable,
        "-c",
        f"from cluster.model.kernel_build import _compile; _compile({variant!r}, {str(into)!r})",
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the CPU kernels for {variant} failed:\n{(done.stderr or done.stdout)[-4000:]}")


def _compile(variant: str, into: str) -> None:
    from torch.utils import cpp_extension

    build = {
        "name": library_name(variant),
        "sources": [str(SOURCE)],
        "extra_include_paths": [str(CSRC)],
        "extra_cflags": cflags(variant),
        "extra_ldflags": ["-fopenmp"],
        "build_directory": into,
        "verbose": False,
    }
    if variant == "portable" or variant in supported():
        cpp_extension.load(**build, is_python_module=False)  # builds, then loads: what loads here is whole
    else:  # for another machine: loading it here would die of an illegal instruction (in its initialisers)
        cpp_extension._write_ninja_file_and_build_library(
            **build, extra_cuda_cflags=[], extra_sycl_cflags=[], with_cuda=False, with_sycl=False
        )


def package(variant: str, into: Path) -> Path:
    """Copies `variant`'s library, built now if no process has built it, into `into` as a wheel
    carries it (`PACKAGED`'s layout): the library alone, without its build's objects."""
    path = built(variant)
    copy = into / path.parent.name / path.name
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path, copy)
    return copy


def prune(variant: str, keep: Path) -> None:
    """Removes all but the `KEPT` newest builds of `variant` (never `keep`, never one being built)."""
    builds = sorted(
        (p for p in keep.parent.glob(f"{variant}-*") if p.is_dir() and ".staging-" not in p.name),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in builds[KEPT:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def held(path: Path, what: str, say_every_s: float = 10.0) -> Iterator[None]:
    """Holds an exclusive lock on `path` for `what`, writing this process into it as its owner.

    The lock is the kernel's (`flock`): it goes with its owner's death, whatever the death, so a
    waiter never waits on the dead. A waiter logs whom it waits for when it starts waiting and every
    `say_every_s` seconds after."""
    with open(path, "a+") as file:
        waited_since = said = None
        while True:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                waited_since = waited_since or now
                if said is None or now - said >= say_every_s:
                    said = now
                    file.seek(0)
                    owner = file.read().strip() or "another process"
                    log.warning("waiting %.0f s so far for %s, held by %s (%s)", now - waited_since, what, owner, path)
                time.sleep(0.2)
        if waited_since is not None:
            log.warning("took over %s after %.1f s", what, time.monotonic() - waited_since)
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        file.flush()
        try:
            yield
        finally:
            file.truncate(0)
            fcntl.flock(file, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the CPU kernels for this CPU (once per source version).")
    parser.add_argument(
        "variants",
        nargs="*",
        help="variants to build (default: the one this CPU runs; 'all': every one it runs, and the plain loops; "
        "'every': every variant there is, for machines of every kind, as an image does)",
    )
    parser.add_argument("--into", type=Path, help="also copy each library into this folder, as a wheel carries them")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    wanted = args.variants or [variant()]
    every = wanted == ["every"]
    if wanted in (["all"], ["every"]):
        wanted = [*(VARIANTS if every else supported()), "portable"]
    for name in wanted:
        if name is None:
            print("CPU kernels: none (TANDEM_CPU_KERNELS=0)")
            continue
        if name != "portable" and name not in supported() and not every:
            raise SystemExit(f"this CPU does not run the {name} kernels (it runs {supported()}; 'every' builds them)")
        started = time.monotonic()
        state = "found built" if library(name).exists() else "built"
        try:
            path = built(name)
        except Exception as e:  # no compiler, say: torch's kernels serve instead, as they would at run time
            if args.into:  # a wheel without them would build them in its first process: refuse instead
                raise SystemExit(f"CPU kernels for {name}: not built ({e})") from e
            print(f"CPU kernels for {name}: not built, torch's kernels will be used ({e})")
            continue
        elsewhere = (
            "" if name == "portable" or name in supported() else " (for other machines: this CPU cannot run them)"
        )
        print(f"CPU kernels for {name}: {state} ({time.monotonic() - started:.1f} s) at {path}{elsewhere}")
        if args.into:
            print(f"  copied to {package(name, args.into)}")


if __name__ == "__main__":
    main()
