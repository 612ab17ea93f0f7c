"""`tandem dashboards --out DIR`: a Prometheus scrape configuration and Grafana dashboards.

The dashboards are built from the metric objects of `cluster.telemetry.Metrics` and the names of
`cluster.telemetry.RAY_METRICS` (with Ray's `ray_` prefix), never from names typed here, so a
renamed metric renames its panels; `tests/test_prometheus.py` checks every query against a real
Prometheus. The scrape configuration lists the router's and every worker's `/metrics` (from a
running router's `Admin.GetStatus`, each worker target labelled with its `worker` and `role`) and
Ray's exporters (Ray's own service-discovery file, or the addresses given).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from cli.admin import get_status
from cli.client_options import add_client_options
from cluster.telemetry import RAY_METRICS, RAY_PREFIX, Metrics

# Where a local Ray writes its exporters' addresses for Prometheus's file_sd (the head node's).
RAY_SERVICE_DISCOVERY = "/tmp/ray/prom_metrics_service_discovery.json"
DASHBOARD_FILE = "tandem.json"
RATE = "[1m]"
WORKERS = '{worker!=""}'  # the series of worker targets (every process serves the gauges; workers set them)


def _name(metric: Any) -> str:
    return str(metric.describe()[0].name)


def _ray(name: str) -> str:
    assert name in RAY_METRICS, name
    return RAY_PREFIX + name + ("_total" if RAY_METRICS[name][0] == "counter" else "")


def _quantiles(metric: Any, by: str = "") -> list[tuple[str, str]]:
    labels = f"le{', ' + by if by else ''}"
    legend = f"p{{q}}{' {{' + by + '}}' if by else ''}"
    return [
        (
            f"histogram_quantile({q}, sum by ({labels}) (rate({_name(metric)}_bucket{RATE})))",
            legend.replace("{q}", str(int(q * 100))),
        )
        for q in (0.5, 0.9, 0.99)
    ]


def _rows(m: Metrics) -> list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]]:
    """(row title, [(panel title, unit, [(PromQL, legend)])])."""
    requests, slo = _name(m.requests), _name(m.slo_requests)
    return [
        ("Latency", [
            ("TTFT", "s", _quantiles(m.ttft)),
            ("TPOT", "s", _quantiles(m.tpot)),
            ("ITL", "s", _quantiles(m.itl)),
            ("E2E", "s", _quantiles(m.e2e)),
        ]),
        ("SLO and goodput", [
            ("SLO attainment (per router)", "percentunit", [(_name(m.slo_attainment), "{{instance}}")]),
            ("Goodput (requests/s meeting every SLO)", "reqps",
             [(f'sum(rate({slo}_total{{met="true"}}{RATE}))', "goodput"),
              (f"sum(rate({slo}_total{RATE}))", "finished")]),
            ("Requests by status", "reqps", [(f"sum by (status) (rate({requests}_total{RATE}))", "{{status}}")]),
        ]),
        ("Pools and autoscaling", [
            ("Pool size", "short", [(f"max by (pool) ({_ray('tandem_pool_workers')})", "{{pool}} serving"),
                                    (f"max by (pool) ({_ray('tandem_pool_target')})", "{{pool}} target")]),
            ("Autoscaler decisions", "short",
             [(f"sum by (pool, direction) (increase({_ray('tandem_scaling_decisions')}[5m]))",
               "{{pool}} {{direction}}")]),
        ]),
        ("KV cache and queues", [
            ("KV cache use", "percentunit", [(_name(m.kv_usage) + WORKERS, "{{worker}}")]),
            ("Running and waiting sequences", "short",
             [(_name(m.running) + WORKERS, "{{worker}} running"), (_name(m.waiting) + WORKERS, "{{worker}} waiting")]),
            ("Queueing by stage", "s", _quantiles(m.queue, "stage")),
            ("Queued prompt tokens", "short", [(_ray("tandem_queued_prompt_tokens"), "{{worker}}")]),
        ]),
        ("KV transfer and migrations", [
            ("KV transfer bytes/s", "Bps",
             [(f"sum by (transport) (rate({_name(m.kv_bytes)}_sum{RATE}))", "{{transport}}")]),
            ("KV transfer time", "s", _quantiles(m.kv_transfer, "transport")),
            ("KV transfer failures", "short",
             [(f"sum by (code) (increase({_name(m.transfer_failures)}_total[5m]))", "{{code}}")]),
            ("Migrations", "short",
             [(f"sum by (failed) (increase({_name(m.migrations)}_total[5m]))", "{{failed}} failed")]),
        ]),
    ]  # fmt: skip


def grafana_dashboard() -> dict[str, Any]:
    """The Grafana dashboard (JSON model) of a Tandem cluster, on a Prometheus data source."""
    metrics = Metrics()
    source = {"type": "prometheus", "uid": "${datasource}"}
    panels: list[dict[str, Any]] = []
    y = 0
    for row, row_panels in _rows(metrics):
        panels.append({"id": len(panels) + 1, "type": "row", "title": row, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})  # fmt: skip
        y += 1
        for i, (title, unit, queries) in enumerate(row_panels):
            panels.append({
                "id": len(panels) + 1, "type": "timeseries", "title": title, "datasource": source,
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)},
                "targets": [{"refId": chr(65 + j), "expr": expr, "legendFormat": legend, "datasource": source}
                            for j, (expr, legend) in enumerate(queries)],
            })  # fmt: skip
        y += 8 * ((len(row_panels) + 1) // 2)
    return {
        "uid": "tandem-cluster", "title": "Tandem cluster", "tags": ["tandem"], "schemaVersion": 39,
        "editable": True, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus"}]},
        "panels": panels,
    }  # fmt: skip


def expressions(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def scrape_config(status: Any | None, ray_targets: list[str], interval_s: float = 15.0) -> dict[str, Any]:
    """prometheus.yml: the routers and workers `status` (a `ClusterStatus`) lists, and Ray's
    exporters (`ray_targets`, else Ray's service-discovery file on this host)."""
    interval = f"{interval_s:g}s"
    jobs: list[dict[str, Any]] = []
    if status is not None:
        routers = sorted({r.metrics_address for r in status.routers if r.metrics_address})
        jobs.append({"job_name": "tandem-router", "static_configs": [{"targets": routers}]})
        workers = [
            {"targets": [w.load.metrics_address], "labels": {"worker": w.name, "role": w.load.role}}
            for w in status.workers
            if w.load.metrics_address
        ]
        jobs.append({"job_name": "tandem-workers", "static_configs": workers})
    ray = {"static_configs": [{"targets": ray_targets}]} if ray_targets else {
        "file_sd_configs": [{"files": [RAY_SERVICE_DISCOVERY]}]
    }  # fmt: skip
    jobs.append({"job_name": "ray", **ray})
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval}, "scrape_configs": jobs}


def add_commands(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("dashboards", help="write a Prometheus scrape config and Grafana dashboards")
    p.add_argument("--out", required=True, help="folder for prometheus.yml and grafana/tandem.json")
    add_client_options(p, None, "a running router (HOST:PORT) whose status lists the endpoints")
    p.add_argument("--ray-metrics", action="append", default=[], help="a Ray metrics exporter HOST:PORT (repeat)")
    p.add_argument("--scrape-interval", type=float, default=15.0, help="seconds between scrapes (default: 15)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    status = get_status(args) if args.target else None
    out = Path(args.out)
    (out / "grafana").mkdir(parents=True, exist_ok=True)
    (out / "grafana" / DASHBOARD_FILE).write_text(json.dumps(grafana_dashboard(), indent=2) + "\n")
    config = scrape_config(status, args.ray_metrics, args.scrape_interval)
    (out / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    print(f"wrote {out / 'prometheus.yml'} and {out / 'grafana' / DASHBOARD_FILE}")
    return 0
