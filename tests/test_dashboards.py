"""`tandem dashboards` without a cluster: every Grafana query names a metric Tandem defines (a
bare name from `cluster.telemetry.Metrics`, or a `ray_` one from `RAY_METRICS`), the chart's copy
of the dashboard is the generated one, the scrape configuration lists what a status gives, and
what `tandem serve` prints about Ray's dashboard. `tests/test_prometheus.py` runs the queries."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from tandem.v1 import worker_pb2

from cli import dashboards
from cli.main import main as cli
from cluster.pools.ray_observe import RayView
from cluster.telemetry import RAY_METRICS, RAY_PREFIX, Metrics

ROOT = Path(__file__).resolve().parents[1]


def defined() -> set[str]:
    names = set()
    for family in Metrics().registry.collect():
        suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}.get(family.type, ("",))
        names |= {family.name + s for s in suffixes}
    for name, (kind, _, _) in RAY_METRICS.items():
        names.add(RAY_PREFIX + name + ("_total" if kind == "counter" else ""))
    return names


def test_every_panel_names_a_defined_metric_and_each_asked_for_area_has_a_panel():
    board = dashboards.grafana_dashboard()
    exprs = dashboards.expressions(board)
    for expr in exprs:
        named = set(re.findall(r"\b(?:ray_)?tandem_[a-z0-9_]+\b", expr))
        assert named and named <= defined(), (expr, named - defined())
    titles = " | ".join(p["title"] for p in board["panels"])
    wanted = ("TTFT", "TPOT", "ITL", "Goodput", "SLO attainment", "Pool size", "Autoscaler decisions", "KV cache use",
              "Queueing by stage", "KV transfer bytes", "KV transfer time", "Migrations")  # fmt: skip
    for title in wanted:
        assert title in titles
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


def test_the_charts_dashboard_is_the_generated_one():
    chart = json.loads((ROOT / "helm" / "tandem" / "files" / "grafana-tandem.json").read_text())
    assert chart == dashboards.grafana_dashboard(), "regenerate it: tandem dashboards --out DIR"


def test_the_scrape_config_lists_routers_workers_and_ray(tmp_path):
    status = worker_pb2.ClusterStatus(
        routers=[worker_pb2.RouterStatus(name="router-a", metrics_address="127.0.0.1:9100")],
        workers=[
            worker_pb2.WorkerStatus(name=f"{role}-0", load=worker_pb2.WorkerLoad(role=role, metrics_address=f"h:{i}"))
            for i, role in ((1, "decode"), (2, "prefill"))
        ],
    )  # fmt: skip
    config = dashboards.scrape_config(status, ["h:8080"], interval_s=2)
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["tandem-router"]["static_configs"] == [{"targets": ["127.0.0.1:9100"]}]
    assert jobs["tandem-workers"]["static_configs"] == [
        {"targets": ["h:1"], "labels": {"worker": "decode-0", "role": "decode"}},
        {"targets": ["h:2"], "labels": {"worker": "prefill-0", "role": "prefill"}},
    ]
    assert jobs["ray"]["static_configs"] == [{"targets": ["h:8080"]}]
    assert config["global"]["scrape_interval"] == "2s"
    alone = dashboards.scrape_config(None, [])  # no router to ask: Ray's own service discovery
    assert alone["scrape_configs"] == [
        {"job_name": "ray", "file_sd_configs": [{"files": [dashboards.RAY_SERVICE_DISCOVERY]}]}
    ]

    assert cli(["dashboards", "--out", str(tmp_path)]) == 0
    assert yaml.safe_load((tmp_path / "prometheus.yml").read_text())["scrape_configs"][0]["job_name"] == "ray"
    assert json.loads((tmp_path / "grafana" / "tandem.json").read_text()) == dashboards.grafana_dashboard()


def test_serve_says_where_the_dashboard_is_and_how_to_authenticate():
    lines = RayView("http://127.0.0.1:8265", True, "10.0.0.1:8080").lines()
    assert lines[0].startswith("Ray dashboard at http://127.0.0.1:8265; it asks for Ray's token")
    assert "`ray get-auth-token`" in lines[0]
    assert lines[1] == "Ray's metrics exporter at http://10.0.0.1:8080/metrics (Tandem's series there start with ray_)"
    assert RayView("http://127.0.0.1:8265", False, None).lines() == ["Ray dashboard at http://127.0.0.1:8265"]
