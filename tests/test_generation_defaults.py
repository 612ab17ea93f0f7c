"""The model's own sampling defaults (generation_config.json) fill what a request leaves unset.

A copy of the demo model whose generation_config.json sets `top_k: 1` (sampling that can only pick
the likeliest token) behind real workers and two routers in this process: one applying the model's
defaults (`model.generation_config: auto`, the default), one not (`none`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cli.serve import sampling_note
from cluster.config import parse_config
from cluster.model.arch import ModelFormatError
from cluster.model.tokenizer import sampling_defaults
from decode_worker import service as decode_service
from router.sdk.client import Client
from router.service import server as router_server

DEMO = Path(__file__).resolve().parents[1] / "models" / "tandem-demo-code"
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range("]

pytestmark = pytest.mark.slow


def config(folder: Path, generation_config: str = "auto"):
    return parse_config({
        "model": {"path": str(folder), "dtype": "float32", "generation_config": generation_config},
        "scheduler": {"engine_core": "thread"},  # the core process: test_engine_core.py, the Ray modules
        "cache": {"block_size": 16, "num_blocks": 128},
        "router": {"local_prefill_max_tokens": 4096},
    })  # fmt: skip


@pytest.fixture(scope="module")
def routers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model") / "greedy-by-default"
    shutil.copytree(DEMO, folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "top_k": 1, "temperature": 0.7}))
    decode = decode_service.from_config(config(folder), "decode-0")
    workers = {"decode-0": decode.start()}
    made = {mode: router_server.from_config(config(folder, mode), lambda: workers) for mode in ("auto", "none")}
    addresses = {mode: router.start() for mode, router in made.items()}
    yield folder, addresses
    for router in made.values():
        router.stop()
    decode.stop()


def test_a_request_that_leaves_sampling_unset_gets_the_models_defaults(routers):
    folder, addresses = routers
    with Client(addresses["auto"]) as auto, Client(addresses["none"]) as none:
        greedy = [auto.generate(p, max_tokens=12, temperature=0).token_ids for p in PROMPTS]
        assert [auto.generate(p, max_tokens=12, seed=3).token_ids for p in PROMPTS] == greedy, "top_k 1: greedy"
        sampled = [none.generate(p, max_tokens=12, seed=3).token_ids for p in PROMPTS]
        assert sampled != greedy, "Tandem's defaults (temperature 1, no top_k) sample"
        # a field the request sets is its own: the same request on either router samples alike
        explicit = {"max_tokens": 12, "seed": 3, "top_k": 50, "temperature": 1.0}
        assert [auto.generate(p, **explicit).token_ids for p in PROMPTS] == [
            none.generate(p, **explicit).token_ids for p in PROMPTS
        ]
    assert sampling_note(config(folder)).endswith(
        "generation_config.json: temperature 0.7, top_k 1 (model.generation_config: none turns them off)"
    )
    assert "Tandem's" in sampling_note(config(folder, "none")) and "sets none" in sampling_note(config(DEMO))


def test_a_bad_default_is_refused_by_name(tmp_path):
    assert sampling_defaults({"top_p": 0.9, "do_sample": True}, tmp_path) == {"top_p": 0.9}
    for bad in ({"top_k": 1.5}, {"temperature": "hot"}, {"top_p": True}):
        with pytest.raises(ModelFormatError, match=next(iter(bad))):
            sampling_defaults(bad, tmp_path / "generation_config.json")
