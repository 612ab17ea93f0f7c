"""Imports point inward, and `cluster`'s subpackages keep their layers:

- `cli`, the `tandem` command line, stands on top: it may import every package, and none imports it;
- workers and the router import `cluster`; `cluster` imports none of them;
- `cluster.model` imports nothing from `cluster.engine`, `cluster.kv` or `cluster.pools`;
- `cluster.engine` imports no `cluster.kv`, `cluster.pools`, gRPC or Ray;
- only `cluster.pools` imports Ray (in `cluster`; the workers' Ray actors are built there too);
- nothing in the cluster imports `planner`, and `planner` imports no torch, Ray or gRPC (but
  `planner.measure`, which times the model);
- the router's process and the `tandem` command's, until it starts a worker or a model in it, load
  no torch (2.5 s of every start, and memory, for nothing).

The checker runs on the project and on a small planted tree, so a wrong import is shown to fail.
And the code passes the project's linter."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package (or subpackage, dotted) -> what no module under it may import (top-level or dotted prefixes)
RULES = {
    "cluster": {"prefill_worker", "decode_worker", "router", "planner", "cli"},
    "prefill_worker": {"decode_worker", "router", "planner", "cli"},
    "decode_worker": {"prefill_worker", "router", "planner", "cli"},
    "router": {"prefill_worker", "decode_worker", "planner", "cli"},
    "planner": {"torch", "ray", "grpc", "cli"},
    "cluster.model": {"cluster.engine", "cluster.kv", "cluster.pools", "grpc", "ray"},
    "cluster.engine": {"cluster.kv", "cluster.pools", "grpc", "ray"},
    "cluster.kv": {"cluster.pools", "ray"},
}
# (module, forbidden prefix) pairs a rule allows: the profiler runs the model
ALLOWED = {("planner.measure", "torch")}
PACKAGES = ("cluster", "prefill_worker", "decode_worker", "router", "planner", "cli")
RAY_ONLY_IN = "cluster.pools"  # within cluster, the one subpackage that talks to Ray


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, dotted, absolute imports only (the project uses no relative ones)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def violations(root: Path) -> list[str]:
    """'file imports module (rule)' for every import under `root` that breaks a rule."""
    found = []
    paths = [p for package in PACKAGES if (root / package).is_dir() for p in (root / package).rglob("*.py")]
    for path in sorted(paths):
        relative = path.relative_to(root)
        module = ".".join(relative.with_suffix("").parts)
        imports = imported_modules(path)
        for package, forbidden in RULES.items():
            if module != package and not module.startswith(package + "."):
                continue
            for name in sorted(imports):
                if any((name == f or name.startswith(f + ".")) and (module, f) not in ALLOWED for f in forbidden):
                    found.append(f"{relative} imports {name} (a {package} module must not)")
        if module.startswith("cluster.") and not module.startswith(RAY_ONLY_IN):
            for name in sorted(imports):
                if name == "ray" or name.startswith("ray."):
                    found.append(f"{relative} imports {name} (only {RAY_ONLY_IN} imports Ray)")
    return sorted(set(found))


def test_the_project_keeps_its_layers():
    assert violations(ROOT) == []


def plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("name", "source", "complaint"),
    [
        ("cluster/model/causal_lm.py", "from cluster.engine.sampler import Sampler\n", "cluster.engine.sampler"),
        ("cluster/model/loader.py", "import cluster.kv.wire\n", "cluster.kv.wire"),
        ("cluster/engine/sampler.py", "import grpc\n", "imports grpc"),
        ("cluster/engine/request.py", "from cluster.pools import ray_cluster\n", "cluster.pools"),
        ("cluster/kv/wire.py", "import ray\n", "imports ray"),
        ("cluster/telemetry.py", "from ray.util import metrics\n", "only cluster.pools imports Ray"),
        ("cluster/config.py", "from router.client import Client\n", "router.client"),
        ("decode_worker/engine.py", "import prefill_worker.engine\n", "prefill_worker.engine"),
        ("cluster/pools/autoscaling.py", "from planner import search\n", "planner"),
        ("router/server.py", "import planner.sim\n", "planner.sim"),
        ("planner/sim.py", "import torch\n", "imports torch"),
        ("router/server.py", "from cli.main import main\n", "cli.main"),
        ("cluster/config.py", "import cli.model\n", "cli.model"),
        ("planner/search.py", "from cli import plan\n", "imports cli"),
    ],
)
def test_a_planted_wrong_import_is_caught(tmp_path, name, source, complaint):
    fine = {
        "cluster/pools/ray_cluster.py": "import ray\nfrom cluster.model import arch\n",
        "cluster/engine/model_runner.py": "from cluster.model.causal_lm import CausalLM\n",
        "cluster/kv/grpc_transport.py": "import grpc\nfrom cluster.engine.request import Request\n",
        "router/server.py": "from cluster.kv import wire\n",
        "cli/main.py": "from cli.plan import add_commands\nfrom router.server import Router\n",
        "cli/plan.py": "from planner import search\nfrom cluster.config import load_config\n",
        "planner/measure.py": "import torch\nfrom cluster.model import arch\n",
        "planner/routing.py": "from router import placement\n",
    }
    assert violations(plant(tmp_path / "fine", fine)) == []
    found = violations(plant(tmp_path / "bad", {**fine, name: source}))
    assert len(found) >= 1 and all(complaint in f or name in f for f in found), found
    assert any(complaint in f for f in found), found


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, tuple[Path, set[str]]]:
    """module -> (its file, the project modules it imports). Every absolute import counts, those
    inside functions too; `import a.b.c` and `from a.b import c` name `a.b.c` where that module
    exists and `a.b` otherwise. A package is its `__init__.py`."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")) if (root / package).is_dir() else []:
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str:
        return name if name in files else name.rpartition(".")[0]

    graph = {}
    for module, path in files.items():
        named = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                named.update(resolve(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                named.update(resolve(f"{node.module}.{alias.name}") for alias in node.names)
        graph[module] = (path, {name for name in named if name in files and name != module})
    return graph


def import_circles(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[list[str]]:
    """The files of each strongly connected component of more than one module (Tarjan)."""
    graph = import_graph(root, packages)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module][1]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(component) > 1:
                found.append(sorted(str(graph[m][0].relative_to(root)) for m in component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def test_the_project_has_no_import_circle():
    """The import graph of the project's packages has no circle (`cluster` lowest, then the workers,
    the router, the planner and the command line), imports inside functions included."""
    circles = import_circles(ROOT)
    assert circles == [], "import circles: " + "; ".join(" <-> ".join(files) for files in circles)


@pytest.mark.parametrize(
    ("b_source", "circle"),
    [
        ("def f():\n    import cluster.a\n", True),
        ("def f():\n    from cluster.a import g\n", True),
        ("def f():\n    from cluster import a\n", True),
        ("import cluster.c\n", False),
        ("from cluster import c\n", False),
    ],
)
def test_a_planted_import_circle_is_caught(tmp_path, b_source, circle):
    tree = {
        "cluster/__init__.py": "",
        "cluster/a.py": "import cluster.b\n\n\ndef g():\n    pass\n",
        "cluster/b.py": b_source,
        "cluster/c.py": "import json\n",
    }
    found = import_circles(plant(tmp_path, tree))
    assert found == ([["cluster/a.py", "cluster/b.py"]] if circle else []), found


def test_the_router_and_the_command_line_load_no_torch():
    modules = ["cli.main", "cli.serve", "router.service.server", "router.service.replicas", "router.openai.app"]
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint(sorted(m for m in sys.modules if m == 'torch'))"
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'proto'}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", "a module these import loads torch"


def test_ruff_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is part of the dev extra"
    for args in (["check", "."], ["format", "--check", "."]):
        result = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_the_map_names_every_module():
    """docs/map.md has a row for every module of `cluster` (under its subpackage's heading) and of
    the workers, the router, the planner and the command line, so the map cannot fall behind the tree."""
    text = (ROOT / "docs" / "map.md").read_text()
    sections = {m.group(1): m.start() for m in re.finditer(r"^## `(cluster[\w.]*)`", text, re.M)}
    assert {"cluster", "cluster.model", "cluster.engine", "cluster.kv", "cluster.pools"} <= set(sections)
    missing = []
    for path in sorted((ROOT / "cluster").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            continue
        package, name = ".".join(parts[:-1]), parts[-1]
        start = sections[package]
        end = min([s for s in sections.values() if s > start] + [len(text)])
        if f"| `{name}` |" not in text[start:end]:
            missing.append(f"{'/'.join(parts)}.py (in the {package} table)")
    for package in ("prefill_worker", "decode_worker", "router", "planner", "cli"):
        for path in sorted((ROOT / package).rglob("*.py")):  # subpackages too: `router/openai/app`
            name = path.relative_to(ROOT).with_suffix("").as_posix()
            if path.stem != "__init__" and f"| `{name}` |" not in text:
                missing.append(f"{name}.py")
    assert not missing, f"docs/map.md lacks rows for {missing}"
