"""lm-evaluation-harness scores a model served by Tandem as it scores the weights: a multiple-choice
task and a perplexity task, written into the repo as local data (`tests/data/lm_eval`), run through
lm-eval's `local-completions` model against a served cluster of SmolLM2-135M-Instruct (float32, one
prefill and one decode worker: short requests prefilled on the decode worker, long ones on the
prefill worker), and through lm-eval's `hf` model on the same weights in float32. The accuracies
are equal and every item's log-likelihood is within 1e-3."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import parse_config
from tests.served import serving

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parent / "data" / "lm_eval"


def tasks() -> list[dict]:
    """The two tasks as lm-eval configs, reading the repo's JSON lines (no download)."""
    local = {"dataset_path": "json", "test_split": "test", "num_fewshot": 0}
    return [
        {
            **local, "task": "tandem_choice", "dataset_kwargs": {"data_files": {"test": str(DATA / "choice.jsonl")}},
            "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
        },
        {
            **local, "task": "tandem_text", "dataset_kwargs": {"data_files": {"test": str(DATA / "text.jsonl")}},
            "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
            "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")],
        },
    ]  # fmt: skip


@pytest.fixture(scope="module")
def served(smollm2):
    config = parse_config(
        {
            "model": {"path": str(smollm2), "dtype": "float32", "name": "smollm2"},
            "scheduler": {"engine_core": "thread"},
            "cache": {"block_size": 16, "num_blocks": 256},
            "router": {"local_prefill_max_tokens": 12},
        }
    )
    with serving(config, "smollm2") as cluster:
        yield cluster.base, cluster.router


def _loglikelihood(response) -> float:  # type: ignore[no-untyped-def]
    """A multiple-choice response is (log-likelihood, is greedy); a rolling one the log-likelihood."""
    return float(response[0] if isinstance(response, tuple | list) else response)


def evaluate(lm) -> tuple[dict, dict]:  # type: ignore[no-untyped-def]
    """Each task's metrics, and each item's log-likelihoods in document order."""
    import lm_eval

    out = lm_eval.simple_evaluate(model=lm, tasks=tasks(), log_samples=True, bootstrap_iters=0)
    items = {
        task: [[_loglikelihood(r) for r in s["filtered_resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])]
        for task, samples in out["samples"].items()
    }
    return out["results"], items


def test_lm_eval_scores_the_served_model_as_it_scores_the_weights(served, smollm2_hf, tmp_path, monkeypatch):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    base, router = served
    hf_model, hf_tokenizer = smollm2_hf
    hf_tokenizer.save_pretrained(tmp_path / "tokenizer")  # lm-eval's API models load a tokenizer by path
    api = LocalCompletionsAPI(
        base_url=f"{base}/v1/completions", model="smollm2", tokenizer=str(tmp_path / "tokenizer"),
        tokenizer_backend="huggingface", batch_size=4, max_retries=1,
    )  # fmt: skip
    served_results, served_items = evaluate(api)
    local_results, local_items = evaluate(HFLM(pretrained=hf_model, tokenizer=hf_tokenizer, batch_size=1))

    choice, text = served_results["tandem_choice"], served_results["tandem_text"]
    assert choice["acc,none"] == local_results["tandem_choice"]["acc,none"]
    assert choice["acc_norm,none"] == local_results["tandem_choice"]["acc_norm,none"]
    assert choice["acc,none"] > 0.25, "better than chance (one in four)"
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert text[metric] == pytest.approx(local_results["tandem_text"][metric], rel=1e-4)
    for task in ("tandem_choice", "tandem_text"):
        assert len(served_items[task]) == len(local_items[task]) > 0
        for served_item, local_item in zip(served_items[task], local_items[task], strict=True):
            assert served_item == pytest.approx(local_item, abs=1e-3), task
    placements = router.dispatcher.decisions
    assert sum(n for reason, n in placements.items() if "local" in reason) > 0, placements
    assert sum(n for reason, n in placements.items() if "local" not in reason) > 0, placements
