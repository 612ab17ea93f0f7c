"""The GPU machine's imports, on this machine: what `benchmarks/gpu_check.sh --dry-run` runs under.

    python benchmarks/gpu_dry_site.py DIR

writes DIR/sitecustomize.py (this file) and DIR/packages/, links to the installed distributions the GPU
machine has (`GPU_MACHINE`, as its image was last read) or the check carries as wheels
(scripts/gpu_wheels.txt), and nothing else. With DIR first on PYTHONPATH, Python imports this module at
start-up in the check's process and in every process it starts (site's `sitecustomize` hook), and it
swaps the interpreter's site-packages for DIR/packages: importing Ray, pydantic-free FastAPI or any other
package that is on neither list fails as it would on the GPU machine (`ModuleNotFoundError`), and
`importlib.metadata` sees only what is linked. What the dry run imports, the GPU machine can.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

# The GPU machine's Python packages (nvidia-h200 image 'cuda', read on 2026-11-17): no ray, pydantic,
# opentelemetry, grpcio-health-checking, grpcio-reflection, fastapi or uvicorn.
GPU_MACHINE_PACKAGES = """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
    jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
    numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
    onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning
    pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
    sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
    tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers
    toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
    triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
    xxhash yarl zipp
"""
GPU_MACHINE = frozenset(GPU_MACHINE_PACKAGES.split())
WHEELS = Path(__file__).resolve().parents[1] / "scripts" / "gpu_wheels.txt"


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def carried(wheels: Path = WHEELS) -> set[str]:
    """The distributions scripts/gpu_wheels.txt lists."""
    lines = (line.split("#")[0].strip() for line in wheels.read_text().splitlines())
    return {normalise(line.split("==")[0]) for line in lines if line}


def allowed(installed: dict[str, object]) -> set[str]:
    """The GPU machine's and the carried distributions, with what each needs as installed here: the
    machine holds its own packages' needs (this machine's versions may need others, httpx2 for
    huggingface-hub, say)."""
    names = (GPU_MACHINE | carried()) & installed.keys()
    todo = list(names)
    while todo:
        for requirement in installed[todo.pop()].requires or []:  # type: ignore[attr-defined]
            name = normalise(re.split(r"[ ;<>=!~\[(]", requirement, maxsplit=1)[0])
            if "extra ==" not in requirement and name in installed and name not in names:
                names.add(name)
                todo.append(name)
    return names


def build(out: Path) -> list[str]:
    """Links every allowed installed distribution's top-level files into out/packages; returns their names."""
    from importlib import metadata

    installed = {normalise(d.metadata["Name"]): d for d in metadata.distributions()}
    allowed_names = allowed(installed)  # type: ignore[arg-type]
    packages = out / "packages"
    shutil.rmtree(packages, ignore_errors=True)
    packages.mkdir(parents=True)
    linked = []
    for name, dist in installed.items():
        if name not in allowed_names or not dist.files:
            continue
        linked.append(dist.metadata["Name"])
        for top in {f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}:
            source, target = Path(dist.locate_file(top)), packages / top
            if source.exists() and not target.exists():
                target.symlink_to(source)
    shutil.copy(__file__, out / "sitecustomize.py")
    return sorted(linked)


def _swap_site_packages() -> None:
    """Drops the interpreter's site-packages (and an editable install's finders: the GPU machine has
    none, it finds the checkout on PYTHONPATH) for the linked packages."""
    packages = Path(__file__).resolve().parent / "packages"
    kept = [p for p in sys.path if not ("site-packages" in p or "dist-packages" in p or p.startswith("__editable__"))]
    sys.path[:] = [*kept, str(packages)]
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]


if __name__ == "sitecustomize":
    _swap_site_packages()
elif __name__ == "__main__":
    names = build(Path(sys.argv[1]))
    print(f"dry run: {len(names)} installed distributions importable (on the GPU machine or carried)")
