"""The wheel's build steps of its own (`pyproject.toml`'s `[tool.setuptools.cmdclass]`).

A wheel built from the repo carries the CPU kernels built, for every instruction set the dispatch
knows (`cluster.model.kernel_build`), so a process of an installed Tandem finds them built:

    pip wheel --no-build-isolation --no-deps -w dist .

The kernels are built against the torch of the build's environment (`--no-build-isolation`: the
one Tandem runs with), and a process loads them only under the same torch and Python (their key
says so); under another it builds its own, as a source checkout does. Built without torch
(pip's isolated build) it carries none and says so. `TANDEM_WHEEL_KERNELS`
names the variants (default `every`; `all` is this CPU's and the plain loops). An editable install
runs the checkout's sources, whose kernels the Makefile builds.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
log = logging.getLogger(__name__)


class BuildPy(build_py):
    """Python's files as setuptools lays them out, and the kernels' libraries beside `csrc/`."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        into = Path(self.build_lib) / "cluster" / "model" / "kernels"
        shutil.rmtree(into, ignore_errors=True)  # an earlier build's, perhaps for other sources or variants
        if importlib.util.find_spec("torch") is None:  # pip's isolated build: the kernels' torch is not known
            log.warning(
                "no torch in the build's environment: this build carries no CPU kernels, and the first process "
                "that needs them builds them (about a minute). To carry them: "
                "pip wheel --no-build-isolation --no-deps -w dist . (in an environment with torch)"
            )
            return
        variants = os.environ.get("TANDEM_WHEEL_KERNELS", "every").split()
        command = [sys.executable, "-m", "cluster.model.kernel_build", "--into", str(into), *variants]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        subprocess.run(command, cwd=ROOT, env=env, check=True)


class BdistWheel(bdist_wheel):
    """A wheel for this platform and Python: the kernels are native code."""

    def finalize_options(self) -> None:
        self.distribution.has_ext_modules = lambda: True  # so laid out and installed as a platform's files
        super().finalize_options()
