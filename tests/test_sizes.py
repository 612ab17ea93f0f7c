"""Sizes that fit in a head: no module outside `tests/` over 400 lines, no function over 60.

The checker reads every Python file of the project but the tests, the generated stubs and the
virtualenv; an exception is allowed only by name, with its reason, in `EXCEPTIONS` below. It runs on
the project and on a small planted tree, so an oversize module or function is shown to fail."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
SKIPPED_FOLDERS = {".venv", ".git", ".cache", "tests", "build", "dist"}
# "path" or "path::function" -> why it may be over its bound
EXCEPTIONS: dict[str, str] = {
    "cluster/config.py": "the whole config schema, one frozen part per component (STYLE 6): one page to read it on",
    "cluster/pools/ray_cluster.py": "every Ray call of the project in one thin module (STYLE 7): Ray at one edge",
}


def sizes(root: Path) -> dict[str, tuple[int, int]]:
    """'path' and 'path::function' -> (lines, bound), for every module and function under `root`."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if SKIPPED_FOLDERS & set(relative.parts[:-1]) or "_pb2" in path.name:
            continue
        text = path.read_text()
        found[relative.as_posix()] = (len(text.splitlines()), MAX_MODULE_LINES)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{relative.as_posix()}::{node.name}"
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                found[key] = max(found.get(key, (0, 0))[0], length), MAX_FUNCTION_LINES
    return found


def oversize(root: Path, exceptions: dict[str, str]) -> list[str]:
    """'name: N lines (bound B)' for everything over its bound and not excepted."""
    return [
        f"{name}: {lines} lines (bound {bound})"
        for name, (lines, bound) in sizes(root).items()
        if lines > bound and name not in exceptions
    ]


def test_no_module_or_function_is_over_its_bound():
    assert oversize(ROOT, EXCEPTIONS) == []


def test_every_exception_is_still_needed():
    """An exception whose module or function shrank under its bound (or went) leaves the list."""
    over = {name for name, (lines, bound) in sizes(ROOT).items() if lines > bound}
    assert [name for name in EXCEPTIONS if name not in over] == []


def test_a_planted_oversize_module_and_function_are_caught(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "small.py").write_text("def f():\n    return 1\n")
    assert oversize(tmp_path, {}) == []
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pkg" / "long_function.py").write_text(f"def grows():\n{body}\n")
    (tmp_path / "pkg" / "long_module.py").write_text("\n".join(f"y{i} = {i}" for i in range(MAX_MODULE_LINES + 1)))
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_long.py").write_text("\n".join(f"z{i} = {i}" for i in range(MAX_MODULE_LINES + 1)))
    assert oversize(tmp_path, {}) == [
        f"pkg/long_function.py::grows: {MAX_FUNCTION_LINES + 1} lines (bound {MAX_FUNCTION_LINES})",
        f"pkg/long_module.py: {MAX_MODULE_LINES + 1} lines (bound {MAX_MODULE_LINES})",
    ]
    assert oversize(tmp_path, {"pkg/long_module.py": "planted"}) == [
        f"pkg/long_function.py::grows: {MAX_FUNCTION_LINES + 1} lines (bound {MAX_FUNCTION_LINES})"
    ]
