"""The package builds cleanly: setuptools reads pyproject.toml without a deprecation warning (the
SPDX `license` string, every importable folder listed in `packages`), and the wheel carries the
CPU kernels' sources and the generated stubs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_builds_without_setuptools_warnings(tmp_path):
    # Built from a copy of what the package holds (setuptools writes build/ into the source tree),
    # with the environment's own setuptools (pinned in constraints.txt), so no index is needed.
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "build")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {setuptools["package-dir"].get(p, p).split("/")[0] for p in setuptools["packages"] if "." not in p}
    for name in sorted(folders):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "MANIFEST.in", "build_hooks.py"):
        shutil.copy(ROOT / name, source / name)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        # The plain loops' library only, which the set-up step built for these sources: the wheel's
        # kernels are test_kernel_build.py's
        env={**os.environ, "TANDEM_WHEEL_KERNELS": "portable"},
    )
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    for marker in ("deprecated", "BuildBackendWarning", "SetuptoolsDeprecationWarning", "absent from the"):
        assert marker not in output, f"setuptools warned ({marker!r}):\n{output}"
    (wheel,) = tmp_path.glob("tandem_serve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = [n for n in names if n.endswith(".cpp")]
    assert kernels and all(n.startswith("cluster/") for n in kernels), "the CPU kernels' sources ship"
    assert "tandem/v1/api_pb2.py" in names
