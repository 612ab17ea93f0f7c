"""`tandem plan` and `tandem profile`: a plan's table, JSON and PNG; bad input gets a clear error;
the advisor's choice against exhaustive simulation; profile files round-trip and are checked."""

from __future__ import annotations

import json

import pytest

from cli.main import main
from cluster.slo import Targets
from planner import profile as profiles
from planner import search
from planner.profile import DecodeCost, LinearCost, PrefillCost, Profile, StepCosts
from planner.sim import Layout
from planner.workload import WorkloadError, load, parse


def hand_profile() -> Profile:
    step = StepCosts(PrefillCost(0.004, 2e-4, 1e-8), DecodeCost(0.01, 1e-3, 1e-6))
    return Profile({1: step, 2: step}, {"grpc": LinearCost(0.003, 1e-9)}, LinearCost(5e-4, 5e-5), 18432)


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "profile.json"
    profiles.save(hand_profile(), path)
    return path


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_prints_a_ranked_table_and_writes_json_and_png(capsys, tmp_path, profile_file):
    out = tmp_path / "plan"
    code, stdout, _ = run(
        capsys, "plan", "--profile", str(profile_file), "--workload", "disagg", "--slo", "ttft:1000", "tpot:50",
        "--workers", "2", "--requests", "150", "--out", str(out),
    )  # fmt: skip
    assert code == 0, stdout
    assert "recommended:" in stdout and "1P:1D" in stdout and "colocated x2" in stdout
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["recommended"] == data["ranked"][0]
    goodputs = [row["goodput_req_s"] for row in data["ranked"]]
    assert goodputs == sorted(goodputs, reverse=True) and goodputs[0] > 0
    assert set(data["targets"]) == {"prefill", "decode"}
    assert out.with_suffix(".png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"--profile": ["missing.json"]}, "cannot read profile"),
        ({"--slo": ["ttft:0.01", "tpot:0.01"]}, "no layout can meet these SLOs"),
        ({"--slo": ["ttft:500"]}, "needs both ttft:MS and tpot:MS"),
        ({"--slo": ["ttft:fast", "tpot:50"]}, "positive milliseconds"),
        ({"--workload": ["EMPTY"]}, "(it is empty)"),
        ({"--workload": ["nothing-here.yaml"]}, "no workload"),
        ({"--workers": ["0"]}, "--workers must be at least 1"),
    ],
)
def test_plan_rejects_bad_input_clearly(capsys, tmp_path, profile_file, override, message):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"arrival": {"process": "poisson", "rate": 1}, "requests": 0, "classes": []}))
    args = {
        "--profile": [str(profile_file)], "--workload": ["short-chat"], "--slo": ["ttft:1000", "tpot:100"],
        "--workers": ["2"], "--requests": ["60"], "--out": [str(tmp_path / "p")],
    }  # fmt: skip
    args.update({k: [str(empty) if v == "EMPTY" else v for v in vs] for k, vs in override.items()})
    code, _, err = run(capsys, "plan", *(word for key, values in args.items() for word in (key, *values)))
    assert code == 2
    assert message in err and err.startswith("tandem: error:")


def test_profile_rejects_bad_input_clearly(capsys, tmp_path):
    code, _, err = run(capsys, "profile", "--config", str(tmp_path / "none.yaml"))
    assert code == 2 and "cannot read config" in err
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{path: {tmp_path}}}\n")
    code, _, err = run(capsys, "profile", "--config", str(config), "--threads", "one")
    assert code == 2 and "--threads" in err


def test_a_profile_round_trips_and_a_bad_one_names_its_field(tmp_path):
    path = tmp_path / "p.json"
    profiles.save(hand_profile(), path)
    assert profiles.load(path) == hand_profile()
    data = json.loads(path.read_text())
    data["costs"]["1"]["decode"]["row_s"] = -1
    path.write_text(json.dumps(data))
    with pytest.raises(profiles.ProfileError, match=r"costs\.1.*row_s must be a non-negative number"):
        profiles.load(path)
    path.write_text("{")
    with pytest.raises(profiles.ProfileError, match="not valid JSON"):
        profiles.load(path)
    with pytest.raises(profiles.ProfileError, match="no costs for 4 thread"):
        hand_profile().step_costs(4)


def test_an_empty_or_malformed_workload_is_refused():
    with pytest.raises(WorkloadError, match="empty"):
        parse({"arrival": {"process": "poisson", "rate": 1}, "classes": []})
    with pytest.raises(WorkloadError, match="rate"):
        parse({"arrival": {"process": "poisson", "rate": 0}, "classes": [{}]})
    with pytest.raises(WorkloadError, match=r"classes\[0\]\.prompt"):
        parse(
            {
                "arrival": {"process": "gamma", "rate": 1, "cv": 2},
                "classes": [{"output": {"dist": "fixed", "value": 1}}],
            }
        )
    assert load("rag").requests > 0


@pytest.mark.slow
def test_the_advisor_is_within_5_percent_of_exhaustive_search(monkeypatch):
    monkeypatch.setattr(
        search,
        "KNOBS",
        {"local_prefill_max_tokens": (0, 1024), "long_prefill_chunk": (256, 1024), "max_num_seqs": (8, 64)},
    )
    evaluator = lambda: search.Evaluator(hand_profile(), load("disagg"), Targets(1.0, 0.03), requests=120, bisections=4)  # noqa: E731
    advised = search.plan(evaluator(), Layout(1, 1), 3)
    best = search.plan(evaluator(), Layout(1, 1), 3, exhaustive=True)
    assert advised.recommended.goodput >= 0.95 * best.recommended.goodput
    assert advised.simulations < best.simulations
