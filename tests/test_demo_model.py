"""The bundled demo models: small, loadable by Tandem and transformers alike, and actually trained."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster.generate import generate
from cluster.model.loader import load_model
from cluster.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "tandem-demo-code"
DRAFT = ROOT / "models" / "tandem-demo-code-draft"
CARD = ROOT / "models" / "MODEL_CARD.md"


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


def test_sizes_and_files():
    assert folder_bytes(DEMO) <= 20 * 2**20
    assert folder_bytes(DRAFT) <= 3 * 2**20
    for folder in (DEMO, DRAFT):
        for name in (
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "training.json",
        ):
            assert (folder / name).exists(), f"{folder.name}/{name}"
        assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (DEMO / "tokenizer.json").read_bytes() == (DRAFT / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("folder", [DEMO, DRAFT], ids=lambda p: p.name)
def test_greedy_continuation_of_heldout_snippet_matches_transformers(folder):
    from transformers import AutoModelForCausalLM

    tok = Tokenizer(folder)
    snippet = tok.encode((DEMO / "heldout_eval.txt").read_text(encoding="utf-8"))[1000:1064]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([snippet]), max_new_tokens=24, do_sample=False, eos_token_id=None)
    ours = generate(load_model(folder, "float32"), [snippet], 24)[0]
    assert ours.tokens == ref[0, len(snippet) :].tolist()


@pytest.mark.parametrize("folder", [DEMO, DRAFT], ids=lambda p: p.name)
def test_heldout_loss_is_reproduced_and_far_below_uniform(folder):
    recorded = json.loads((folder / "training.json").read_text())
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_demo.py"), "eval", str(folder)],
        check=True,
        capture_output=True,
        text=True,
    )
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["heldout_loss"] == pytest.approx(recorded["heldout_loss"], rel=0.02)
    assert measured["uniform_loss"] == pytest.approx(8.3178, abs=1e-3)  # ln(4096)
    assert measured["heldout_loss"] < 0.6 * measured["uniform_loss"]


def test_model_card_quotes_the_recorded_losses():
    card = CARD.read_text()
    for folder in (DEMO, DRAFT):
        record = json.loads((folder / "training.json").read_text())
        assert f"{record['heldout_loss']:.3f}" in card, folder.name
        assert f"{record['train_loss']:.3f}" in card, folder.name
    assert re.search(r"Python \d+\.\d+\.\d+", card)
