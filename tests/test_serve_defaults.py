"""`tandem serve` needs no config: with no arguments it serves the bundled demo model on a local Ray
with every default, and `tandem serve --model DIR` serves any model folder the same way (as
`vllm serve MODEL` does). A config file still wins for everything but the model `--model` names.
With `--verbose` it says where its start spent its time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import startup
from cluster.config import BUNDLED_MODEL, ConfigError, serve_config
from cluster.model.builder import init_model_folder

pytestmark = pytest.mark.ray  # its slow tests start a Ray cluster

ROOT = Path(__file__).resolve().parents[1]
TANDEM = str(Path(sys.executable).parent / "tandem")


def test_no_config_is_every_default_on_the_bundled_model():
    config = serve_config()
    assert config.model.path == BUNDLED_MODEL and config.model.served_name == "tandem-demo-code"
    assert config.ray_address is None, "a local Ray"
    assert config.prefill.replicas == 1 and config.decode.replicas == 1


def test_model_replaces_the_configs_model_and_keeps_the_rest(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    config_file = tmp_path / "cluster.yaml"
    config_file.write_text("model:\n  path: models/tandem-demo-code\n  dtype: float32\ncache:\n  memory_gib: 0.5\n")
    config = serve_config(config_file, folder)
    assert config.model.path == folder and config.model.served_name == "my-model"
    assert config.model.dtype == "float32" and config.cache.memory_gib == 0.5
    assert serve_config(model=folder).cache.memory_gib == 2.0, "no config: the defaults"


def test_a_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"no model at .*nowhere: pass --model DIR or --config FILE"):
        serve_config(model=tmp_path / "nowhere")


def serve(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [TANDEM, "serve", *args, "--port", "0", "--num-cpus", "2", "--prompt", "def add(a, b):"]
    run_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [*command, "--max-tokens", "6"], cwd=cwd, capture_output=True, text=True, timeout=300, env=run_env
    )


@pytest.mark.slow
def test_serve_without_arguments_answers_on_the_bundled_model_and_says_where_its_start_went(tmp_path):
    # Not the repository: nothing is read relative to it. No `ray_address`: a Ray of its own, never
    # one that `ray start` left running here, nor one in RAY_ADDRESS (nothing listens at port 1).
    result = serve(["--verbose"], cwd=tmp_path, env={"RAY_ADDRESS": "127.0.0.1:1"})
    assert result.returncode == 0, result.stderr
    assert "starting Ray and the tandem-demo-code pools" in result.stderr
    assert result.stdout.startswith("def add(a, b):") and len(result.stdout) > len("def add(a, b):")
    [ready] = [float(line.split()[2]) for line in result.stderr.splitlines() if line.startswith("ready in ")]
    phases = {p.name: p for p in startup.parse(result.stderr.splitlines())}
    assert list(phases) == ["Ray", "pools", "router"], result.stderr
    assert sum(p.seconds for p in phases.values()) <= ready + 0.02
    workers = {w.name: w for w in phases["pools"].parts}
    assert set(workers) == {"decode-0", "prefill-0"}
    for worker in workers.values():
        parts = {p.name: p for p in worker.parts}
        assert list(parts) == ["Ray: placed, process started", "imports", "engine core", "gRPC server"]
        assert sum(p.seconds for p in parts.values()) <= worker.seconds + 0.02
        core = [p.name for p in parts["engine core"].parts]
        assert core[:3] == ["process start, imports", "model", "engine"]


@pytest.mark.slow
def test_serve_model_dir_answers_on_that_folder(tmp_path):
    folder = init_model_folder(tmp_path / "tiny-llama", preset="tiny", dtype="float32")
    result = serve(["--model", str(folder)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "starting Ray and the tiny-llama pools" in result.stderr
    assert result.stdout.startswith("def add(a, b):") and "[finish: length]" in result.stderr
