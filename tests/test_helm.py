"""The Helm chart, `helm/tandem`: linted (`helm lint --strict`) and rendered (`helm template`) by a
real helm binary (scripts/install_helm.sh installs it); every rendered object checked against its
schema: core objects against Kubernetes' OpenAPI schemas (kubernetes-validate, strict), the
RayCluster against KubeRay's CRD made strict (unknown fields rejected) and read back by Ray's own
KubeRay autoscaler code; the values schema's refusals; the embedded cluster config loaded by
Tandem's config schema, as `tandem serve` loads it; and docs/kubernetes.md's values reference
equal to the schema."""

from __future__ import annotations

import asyncio
import base64
import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cluster.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "tandem"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
# The KubeRay CRD is data beside the repository, not part of it (no package on the reachable
# registries ships it): KubeRay's ray-operator/config/crd/bases/ray.io_rayclusters.yaml, kept in
# ../shared/schemas/kuberay/ where CI has it. A plain clone without it skips the CRD checks.
CRD = ROOT.parent / "shared" / "schemas" / "kuberay" / "ray.io_rayclusters.yaml"
CRD_SOURCE = "ray-project/kuberay, ray-operator/config/crd/bases/ray.io_rayclusters.yaml"
HELM = ROOT / ".venv" / "bin" / "helm"
KUBE_VERSION = "1.33.0"
RELEASE, NAMESPACE = "tandem", "tandem-test"
POOLS = ("prefill", "decode")


@pytest.fixture(scope="session")
def helm() -> Path:
    """The pinned helm binary; the install script does nothing when it is already in place."""
    script = ROOT / "scripts" / "install_helm.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(script), str(HELM.parent)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "v4.1.4" in subprocess.run([HELM, "version", "--short"], capture_output=True, text=True).stdout
    return HELM


def run_helm(helm: Path, args: list[str], values: dict | None, tmp_path: Path) -> subprocess.CompletedProcess:
    files = []
    if values is not None:
        files = ["-f", str(tmp_path / "values.yaml")]
        (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    return subprocess.run([helm, *args, *files], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def render(helm, tmp_path_factory):
    """values (a dict, or a chart ci/ file name) -> {(kind, name): object}; renders each set once."""
    cache: dict[str, dict[tuple[str, str], dict]] = {}

    def _render(values: dict | str | None = None) -> dict[tuple[str, str], dict]:
        key = json.dumps(values, sort_keys=True)
        if key not in cache:
            if isinstance(values, str):
                values = yaml.safe_load((CHART / "ci" / values).read_text())
            args = ["template", RELEASE, str(CHART), "-n", NAMESPACE, "--kube-version", KUBE_VERSION]
            result = run_helm(helm, args, values, tmp_path_factory.mktemp("values"))
            assert result.returncode == 0, result.stderr
            docs = [d for d in yaml.safe_load_all(result.stdout) if d]
            cache[key] = {(d["kind"], d["metadata"]["name"]): d for d in docs}
            assert len(cache[key]) == len(docs), "two objects share a kind and name"
        return copy.deepcopy(cache[key])

    return _render


def of_kind(objects: dict, kind: str) -> list[dict]:
    return [o for (k, _), o in objects.items() if k == kind]


def raycluster(objects: dict) -> dict:
    (rc,) = of_kind(objects, "RayCluster")
    return rc


def group(rc: dict, name: str) -> dict:
    (g,) = [g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == name]
    return g


def router(objects: dict) -> dict:
    return objects[("Deployment", f"{RELEASE}-router")]


def controller(objects: dict) -> dict:
    return objects[("Deployment", f"{RELEASE}-controller")]


def container(pod_spec: dict, name: str) -> dict:
    (c,) = [c for c in pod_spec["containers"] if c["name"] == name]
    return c


def cluster_config(objects: dict, tmp_path: Path):
    """The ConfigMap's config, loaded as `tandem serve --config` loads a file."""
    path = tmp_path / "config.yaml"
    path.write_text(objects[("ConfigMap", f"{RELEASE}-config")]["data"]["config.yaml"])
    return load_config(path)


# -- KubeRay's CRD, strict --------------------------------------------------------------------------


def strict(schema: Any) -> Any:
    """The schema with additionalProperties: false on every object schema that lists its properties
    and does not preserve unknown fields (the CRD itself leaves unknown fields to the API server's
    pruning, which would drop a misspelt field silently)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k != "properties" else {p: strict(s) for p, s in v.items()} for k, v in schema.items()}
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


@pytest.fixture(scope="module")
def raycluster_validator() -> jsonschema.Draft7Validator:
    if not CRD.exists():
        pytest.skip(f"KubeRay's RayCluster CRD is not at {CRD} (it comes from {CRD_SOURCE}); skipping its checks")
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(v1["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def validate_all(objects: dict, raycluster_validator) -> None:
    for (kind, name), obj in objects.items():
        if kind == "RayCluster":
            errors = [
                f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in raycluster_validator.iter_errors(obj)
            ]
            assert not errors, f"RayCluster {name}:\n" + "\n".join(errors)
        elif kind == "ServiceMonitor":  # no schema at hand: its selector must find the router's Service
            service = objects[("Service", f"{RELEASE}-router")]
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            assert obj["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
            ports = {p["name"] for p in service["spec"]["ports"]}
            assert {e["port"] for e in obj["spec"]["endpoints"]} <= ports
        else:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


VALUE_SETS = [None, "gpu-values.yaml", "fixed-size-values.yaml", "existing-secret-values.yaml", "ray-ha-values.yaml"]


@pytest.mark.parametrize("values", VALUE_SETS, ids=lambda v: v or "defaults")
def test_lint_strict(helm, tmp_path, values):
    args = ["lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION]
    if values:
        args += ["-f", str(CHART / "ci" / values)]
    result = run_helm(helm, args, None, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("values", VALUE_SETS, ids=lambda v: v or "defaults")
def test_rendered_objects_validate(render, raycluster_validator, values):
    validate_all(render(values), raycluster_validator)


def test_validators_reject_unknown_fields(render, raycluster_validator):
    objects = render()
    rc = raycluster(objects)
    group(rc, "decode")["replica"] = 2  # misspelt replicas
    assert any("'replica' was unexpected" in e.message for e in raycluster_validator.iter_errors(rc))
    rc = raycluster(render())
    group(rc, "prefill")["template"]["spec"]["containers"][0]["resource"] = {}
    assert not raycluster_validator.is_valid(rc)
    deployment = router(objects)
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


def test_strict_leaves_preserved_fields_open():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "c": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {}},
            "d": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }
    validator = jsonschema.Draft7Validator(strict(schema))
    assert validator.is_valid({"a": {"b": "x"}, "c": {"anything": 1}, "d": {"k": "v"}})
    assert not validator.is_valid({"a": {"b": "x", "z": 1}})
    assert not validator.is_valid({"e": 1})
    assert not validator.is_valid({"d": {"k": 1}})


def test_default_render(render, tmp_path):
    objects = render()
    assert sorted(objects) == [
        ("ConfigMap", f"{RELEASE}-config"),
        ("ConfigMap", f"{RELEASE}-scripts"),
        ("Deployment", f"{RELEASE}-controller"),
        ("Deployment", f"{RELEASE}-router"),
        ("PodDisruptionBudget", f"{RELEASE}-router"),
        ("RayCluster", RELEASE),
        ("Secret", f"{RELEASE}-auth"),
        ("Service", f"{RELEASE}-router"),
    ]
    rc = raycluster(objects)
    spec = rc["spec"]
    assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"]["idleTimeoutSeconds"] == 60
    assert "upgradeStrategy" not in spec  # left out for operators whose CRD lacks it
    assert [g["groupName"] for g in spec["workerGroupSpecs"]] == list(POOLS)
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no Tandem worker on the head
    head = container(spec["headGroupSpec"]["template"]["spec"], "ray-head")
    assert {p["name"]: p["containerPort"] for p in head["ports"]}["client"] == 10001
    for name in POOLS:
        g = group(rc, name)
        assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == (1, 1, 4)
        worker = container(g["template"]["spec"], "ray-worker")
        assert worker["resources"]["limits"] == {"cpu": "2", "memory": "8Gi"}
        assert [c["name"] for c in g["template"]["spec"]["initContainers"]] == ["check-model"]

    pod = router(objects)["spec"]["template"]["spec"]
    spec = router(objects)["spec"]
    assert spec["replicas"] == 2 and spec["strategy"]["type"] == "RollingUpdate"
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, "an upgrade keeps every router serving"
    main = container(pod, "router")
    assert main["command"] == ["tandem", "router", "--config", "/run/tandem/config.json", "--timeout", "600"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["grpc"] == {"port": 50051}, probe
    assert main["startupProbe"]["failureThreshold"] * main["startupProbe"]["periodSeconds"] >= 600
    budget = objects[("PodDisruptionBudget", f"{RELEASE}-router")]["spec"]
    assert budget["minAvailable"] == 1
    assert budget["selector"]["matchLabels"].items() <= pod_labels(router(objects)).items()

    # The controller owns the registry and the pools: one pod, replaced (never two at once).
    owner = controller(objects)["spec"]
    assert owner["replicas"] == 1 and owner["strategy"] == {"type": "Recreate"}
    owner_pod = owner["template"]["spec"]
    assert container(owner_pod, "controller")["command"] == ["tandem", "control", "--config", "/run/tandem/config.json"]
    assert [c["name"] for c in owner_pod["initContainers"]] == [c["name"] for c in pod["initContainers"]]
    assert owner_pod["volumes"] == pod["volumes"]
    selector = objects[("Service", f"{RELEASE}-router")]["spec"]["selector"]
    assert not selector.items() <= pod_labels(controller(objects)).items(), "the Service sends no request there"
    checksums = [d["spec"]["template"]["metadata"]["annotations"] for d in (controller(objects), router(objects))]
    assert checksums[0] == checksums[1], "a new config restarts both"
    assert pod["terminationGracePeriodSeconds"] > cluster_config(objects, tmp_path).router.shutdown_timeout_s
    service = objects[("Service", f"{RELEASE}-router")]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 50051, "metrics": 9090}
    assert service["spec"]["selector"].items() <= pod_labels(router(objects)).items()

    secret = objects[("Secret", f"{RELEASE}-auth")]["data"]
    assert decode(secret["api-keys"]) == "" and len(decode(secret["cluster-secret"])) == 48


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def decode(value: str) -> str:
    return base64.b64decode(value).decode()


@pytest.mark.parametrize("values", VALUE_SETS, ids=lambda v: v or "defaults")
def test_config_map_loads_with_tandem_schema(render, tmp_path, values):
    objects = render(values)
    config = cluster_config(objects, tmp_path)
    rc = raycluster(objects)
    assert config.ray_address == f"ray://{rc['metadata']['name']}-head-svc.{NAMESPACE}.svc:10001"
    autoscaled = rc["spec"]["enableInTreeAutoscaling"]
    for name in POOLS:
        pool, g = getattr(config, name), group(rc, name)
        # The pool's workers need the Ray resource its group offers, workersPerNode units a pod.
        per_pod = ray_resources(g["rayStartParams"]["resources"])
        assert pool.resource == name and set(per_pod) == {name}
        n = per_pod[name]
        assert pool.replicas == g["replicas"] * n
        assert (pool.autoscaling.min_replicas, pool.autoscaling.max_replicas) == (
            g["minReplicas"] * n,
            g["maxReplicas"] * n,
        )
        if not autoscaled:
            assert pool.autoscaling.min_replicas == pool.autoscaling.max_replicas == pool.replicas
        limits = container(g["template"]["spec"], "ray-worker")["resources"]["limits"]
        assert pool.num_gpus * n <= int(limits.get("nvidia.com/gpu", 0))
    pod = router(objects)["spec"]["template"]["spec"]
    assert config.router.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
    assert config.router.port == ports["grpc"] and config.router.http_port == ports.get("http")
    relay = container(pod, "metrics-relay")["command"]
    assert f"--to=127.0.0.1:{config.telemetry.metrics_port}" in relay
    assert f"--listen=0.0.0.0:{ports['metrics']}" in relay
    assert config.auth.cluster_secret is None and config.auth.api_keys == ()  # secrets come from the Secret


def ray_resources(param: str) -> dict:
    """A rayStartParams `resources` value read as Ray's KubeRay autoscaler reads it."""
    return json.loads(param[1:-1].replace("\\", ""))


def test_ray_autoscaler_reads_the_groups(render):
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    types = _derive_autoscaling_config_from_ray_cr(raycluster(render("gpu-values.yaml")))["available_node_types"]
    assert types["headgroup"]["resources"]["CPU"] == 0
    for name in POOLS:
        assert types[name]["resources"] == {"CPU": 8, "GPU": 1, "memory": 48 * 2**30, name: 1}
    assert (types["decode"]["min_workers"], types["decode"]["max_workers"]) == (1, 8)


def test_gpu_values(render, tmp_path):
    objects = render("gpu-values.yaml")
    config = cluster_config(objects, tmp_path)
    assert (config.model.device, config.model.dtype) == ("cuda", "bfloat16")
    assert str(config.model.path) == "/models/llama-3.2-1b-instruct"
    rc = raycluster(objects)
    for name in POOLS:
        pod = group(rc, name)["template"]["spec"]
        worker = container(pod, "ray-worker")
        assert worker["image"] == "registry.example.com/tandem:0.1.0-cuda"
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert worker["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in worker["volumeMounts"]
        assert getattr(config, name).num_gpus == 1
    assert "podAntiAffinity" in group(rc, "decode")["template"]["spec"]["affinity"]
    assert rc["spec"]["upgradeStrategy"] == {"type": "Recreate"}
    head = container(rc["spec"]["headGroupSpec"]["template"]["spec"], "ray-head")
    assert "nvidia.com/gpu" not in head["resources"]["limits"]


def test_autoscaling_off(render, tmp_path):
    objects = render("fixed-size-values.yaml")
    rc = raycluster(objects)
    assert rc["spec"]["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in rc["spec"]
    config = cluster_config(objects, tmp_path)
    for name, pods in (("prefill", 2), ("decode", 3)):
        g = group(rc, name)
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == pods
        pool = getattr(config, name)
        assert pool.replicas == pool.autoscaling.min_replicas == pool.autoscaling.max_replicas == 2 * pods


def test_existing_secrets_tls_http_and_monitoring(render, tmp_path):
    objects = render("existing-secret-values.yaml")
    assert of_kind(objects, "Secret") == []
    (monitor,) = of_kind(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    pod = router(objects)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["secrets"]["secret"]["secretName"] == "tandem-credentials"
    assert volumes["tls"]["secret"]["secretName"] == "tandem-tls"
    main = container(pod, "router")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # the kubelet's gRPC probe has no TLS
        command = main[probe]["exec"]["command"]
        assert command[2:] == ["health", "--target=127.0.0.1:50051", "--tls-ca=/var/run/tandem/tls/ca.crt"]
    rc = raycluster(objects)
    specs = [rc["spec"]["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in rc["spec"]["workerGroupSpecs"]
    ]
    for spec in specs:  # every Tandem process reads the same certificate paths
        assert {"name": "tls", "secret": {"secretName": "tandem-tls"}} in spec["volumes"]
    config = cluster_config(objects, tmp_path)
    assert str(config.auth.tls_cert) == "/var/run/tandem/tls/tls.crt" and config.auth.tls_ca is not None
    assert (config.telemetry.exporter, config.telemetry.sample_ratio) == ("otlp-grpc", 0.1)
    assert config.router.http_port == 8000 and config.cache.memory_gib == 4 and config.slo.ttft_s == 0.5
    # The config value is merged under the chart's own keys.
    assert config.decode.autoscaling.upscale_delay_s == 15 and config.decode.autoscaling.max_replicas == 4
    ports = {p["name"] for p in objects[("Service", f"{RELEASE}-router")]["spec"]["ports"]}
    assert ports == {"grpc", "http", "metrics"}


def test_the_grafana_dashboard_ships_beside_the_service_monitor(render):
    from cli.dashboards import grafana_dashboard

    objects = render("existing-secret-values.yaml")
    assert of_kind(objects, "ServiceMonitor")
    (dashboards,) = [o for o in of_kind(objects, "ConfigMap") if o["metadata"]["name"].endswith("-grafana-dashboards")]
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboards["data"]["tandem.json"]) == grafana_dashboard()  # the file is up to date
    assert not [o for o in of_kind(render(None), "ConfigMap") if o["metadata"]["name"].endswith("-dashboards")]


def test_ray_ha_keeps_the_gcs_tables_in_the_charts_redis(render, raycluster_validator, tmp_path):
    """rayHA with the chart's Redis: KubeRay's gcsFaultToleranceOptions name the Redis Service and the
    password's Secret key, which the Redis pod also serves with; Tandem's config says the GCS comes back."""
    objects = render("ray-ha-values.yaml")
    validate_all(objects, raycluster_validator)
    options = raycluster(objects)["spec"]["gcsFaultToleranceOptions"]
    name = f"{RELEASE}-ray-redis"
    assert options["redisAddress"] == f"{name}.{NAMESPACE}.svc:6379"
    assert options["externalStorageNamespace"] == RELEASE
    ref = options["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": name, "key": "redis-password"}
    assert len(decode(objects[("Secret", name)]["data"]["redis-password"])) == 32
    redis = objects[("Deployment", name)]["spec"]
    assert redis["replicas"] == 1 and redis["strategy"] == {"type": "Recreate"}
    (pod_redis,) = redis["template"]["spec"]["containers"]
    assert pod_redis["env"] == [{"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": ref}}]
    assert (
        "--appendonly yes" in pod_redis["command"][-1] and '--requirepass "$REDIS_PASSWORD"' in pod_redis["command"][-1]
    )
    assert redis["template"]["spec"]["volumes"] == [{"name": "data", "persistentVolumeClaim": {"claimName": name}}]
    assert objects[("PersistentVolumeClaim", name)]["spec"]["resources"]["requests"]["storage"] == "1Gi"
    service = objects[("Service", name)]["spec"]
    assert service["selector"].items() <= pod_labels(objects[("Deployment", name)]).items()
    assert cluster_config(objects, tmp_path).ray_ha.fault_tolerant
    assert not cluster_config(render(), tmp_path).ray_ha.fault_tolerant
    assert "gcsFaultToleranceOptions" not in raycluster(render())["spec"]


def test_ray_ha_with_an_external_redis_runs_none_of_its_own(render, raycluster_validator):
    values = {"rayHA": {"enabled": True, "redisAddress": "redis.infra.svc:6380", "externalStorageNamespace": "prod",
                        "passwordSecret": {"name": "infra-redis", "key": "password"}}}  # fmt: skip
    objects = render(values)
    validate_all(objects, raycluster_validator)
    assert raycluster(objects)["spec"]["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis.infra.svc:6380",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "infra-redis", "key": "password"}}},
        "externalStorageNamespace": "prod",
    }
    assert not [key for key in objects if key[1].endswith("-ray-redis")]


def test_rays_metrics_follow_within_the_stated_interval(render):
    from cluster.pools.ray_observe import METRICS_REPORT_INTERVAL_MS

    params = raycluster(render(None))["spec"]["headGroupSpec"]["rayStartParams"]
    assert json.loads(params["system-config"]) == {"metrics_report_interval_ms": METRICS_REPORT_INTERVAL_MS}


def test_one_router_has_no_disruption_budget(render):
    objects = render({"router": {"replicas": 1}})
    assert router(objects)["spec"]["replicas"] == 1
    assert of_kind(objects, "PodDisruptionBudget") == [], "a budget of one router would block every node drain"


def test_secret_from_values(render):
    objects = render({"auth": {"apiKeys": ["key-one", "key-two"], "clusterSecret": "s3cret"}})
    data = objects[("Secret", f"{RELEASE}-auth")]["data"]
    assert decode(data["api-keys"]) == "key-one\nkey-two" and decode(data["cluster-secret"]) == "s3cret"
    config_text = objects[("ConfigMap", f"{RELEASE}-config")]["data"]["config.yaml"]
    assert "key-one" not in config_text and "s3cret" not in config_text


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"prefill": {"replicas": "two"}}, "at '/prefill/replicas': got string, want integer"),
        ({"router": {"port": "50051"}}, "at '/router/port': got string, want integer"),
        ({"router": {"replicas": 0}}, "at '/router/replicas': minimum: got 0, want 1"),
        ({"bogus": 1}, "additional properties 'bogus' not allowed"),
        ({"decode": {"resoures": {}}}, "additional properties 'resoures' not allowed"),
        ({"decode": {"resources": {"cpu": "two"}}}, "/decode/resources/cpu"),
        ({"model": {"dtype": "float16"}}, "at '/model/dtype'"),
        ({"prefill": {"minReplicas": 2}}, "prefill: replicas (1) must lie within minReplicas (2) and maxReplicas (4)"),
        ({"model": {"device": "cuda"}}, "model.device is cuda: prefill.worker.numGpus must be above 0"),
        ({"decode": {"worker": {"numGpus": 1}}}, "decode: workersPerNode (1) x worker.numGpus (1) exceeds"),
        ({"model": {"volume": {"type": "pvc"}}}, "set model.volume.claimName"),
        ({"tls": {"enabled": True}}, "tls.enabled: set tls.existingSecret"),
        ({"router": {"httpPort": 9090}}, "router.port, router.httpPort and router.metricsPort must differ"),
        ({"rayHA": {"enabled": True, "redisAddress": "redis.example:6379"}}, "set rayHA.passwordSecret.name"),
        ({"rayHA": {"redisAddress": "redis.example"}}, "at '/rayHA/redisAddress'"),
    ],
)
def test_bad_values_are_refused(helm, tmp_path, values, message):
    result = run_helm(helm, ["template", RELEASE, str(CHART)], values, tmp_path)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_notes_tell_how_to_reach_router_and_dashboard(helm, tmp_path):
    args = ["install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client"]
    result = run_helm(helm, args, {"router": {"httpPort": 8000}}, tmp_path)
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert f"port-forward service/{RELEASE}-router 50051:50051" in notes
    assert "tandem status --target 127.0.0.1:50051" in notes
    assert "curl http://127.0.0.1:8000/v1/models" in notes
    assert f"port-forward service/{RELEASE}-head-svc 8265:8265" in notes


def test_packaged_chart_renders_the_same_objects(helm, tmp_path, render):
    result = subprocess.run([helm, "package", str(CHART), "-d", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    (package,) = tmp_path.glob("tandem-*.tgz")
    args = ["template", RELEASE, str(package), "-n", NAMESPACE, "--kube-version", KUBE_VERSION]
    result = subprocess.run([helm, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    packaged = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(result.stdout) if d}
    folder = render()
    for objects in (packaged, folder):  # a generated cluster secret differs between renders
        for key, obj in objects.items():
            if key[0] == "Secret":
                obj["data"] = sorted(obj.get("data", {}))
    assert packaged == folder


# -- what the pods run besides Tandem ---------------------------------------------------------------


@pytest.fixture(scope="module")
def pod_helper():
    spec = importlib.util.spec_from_file_location("pod_helper", CHART / "files" / "pod_helper.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_map_ships_the_pod_helper(render):
    data = render()[("ConfigMap", f"{RELEASE}-scripts")]["data"]
    assert data["pod_helper.py"] == (CHART / "files" / "pod_helper.py").read_text()


def test_router_config_composed_from_the_secret(render, pod_helper, tmp_path):
    objects = render(
        {"auth": {"apiKeys": ["key-one", "key-two"]}, "model": {"path": str(ROOT / "models" / "tandem-demo-code")}}
    )
    (tmp_path / "config.yaml").write_text(objects[("ConfigMap", f"{RELEASE}-config")]["data"]["config.yaml"])
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for key, value in objects[("Secret", f"{RELEASE}-auth")]["data"].items():
        (secrets / key).write_text(decode(value))
    args = [
        "config",
        f"--in={tmp_path / 'config.yaml'}",
        f"--secrets={secrets}",
        f"--out={tmp_path / 'run' / 'c.json'}",
    ]
    assert pod_helper.main(args) == 0
    assert (tmp_path / "run" / "c.json").stat().st_mode & 0o777 == 0o600
    config = load_config(tmp_path / "run" / "c.json")  # what `tandem router` and `tandem control` read
    assert [k.get_secret_value() for k in config.auth.api_keys] == ["key-one", "key-two"]
    assert config.auth.cluster_secret.get_secret_value() == decode(
        objects[("Secret", f"{RELEASE}-auth")]["data"]["cluster-secret"]
    )
    (tmp_path / "config.yaml").write_text("model: {path: m}\nprefill: {replicas: 9}\n")
    assert pod_helper.main(args) == 2  # 9 outside the pool's default bounds: refused before serving


def test_check_model(pod_helper, tmp_path, capsys):
    assert pod_helper.main(["check-model", str(ROOT / "models" / "tandem-demo-code")]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    assert pod_helper.main(["check-model", str(tmp_path)]) == 2
    assert "config.json is missing" in capsys.readouterr().err


def test_health_probe(pod_helper):
    from cluster.grpc_server import start_server

    server = start_server(lambda s: [], "127.0.0.1:0")
    try:
        assert pod_helper.main(["health", f"--target={server.address}"]) == 0
        server.set_serving(False)
        assert pod_helper.main(["health", f"--target={server.address}"]) == 1
    finally:
        server.stop(None)
    assert pod_helper.main(["health", f"--target={server.address}", "--timeout=0.5"]) == 1


def test_metrics_relay(pod_helper):
    async def scenario() -> bytes:
        async def upstream(reader, writer):
            writer.write(b"metrics:" + await reader.read(100))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(upstream, "127.0.0.1", 0)
        up_port = server.sockets[0].getsockname()[1]
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # a free port for the relay
        port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        relay = asyncio.create_task(pod_helper._relay(f"127.0.0.1:{port}", f"127.0.0.1:{up_port}"))
        try:
            for _ in range(50):
                try:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    break
                except OSError:
                    await asyncio.sleep(0.02)
            writer.write(b"GET")
            await writer.drain()
            reply = await asyncio.wait_for(reader.read(100), 5)
            writer.close()
            return reply
        finally:
            relay.cancel()
            server.close()

    assert asyncio.run(scenario()) == b"metrics:GET"


# -- values.schema.json, values.yaml and the docs agree -----------------------------------------------


def load_schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def leaves(schema: dict, prefix: str = "") -> list[tuple[str, dict]]:
    """(dotted key, schema) of every value a user sets: scalars, lists and free-form objects."""
    out = []
    for key, sub in schema["properties"].items():
        path = f"{prefix}{key}"
        out += leaves(sub, f"{path}.") if "properties" in sub else [(path, sub)]
    return out


def lookup(values: dict, path: str) -> Any:
    for part in path.split("."):
        values = values[part]
    return values


def values_reference() -> str:
    """The values table of docs/kubernetes.md, as the schema and values.yaml give it."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for path, sub in leaves(load_schema()):
        if "enum" in sub:
            kind = (
                "one of " + ", ".join(f"`{e}`" for e in sub["enum"] if e) + (" or empty" if "" in sub["enum"] else "")
            )
        else:
            types = sub["type"] if isinstance(sub["type"], list) else [sub["type"]]
            kind = " or ".join(types)
        default = json.dumps(lookup(values, path))
        rows.append(f"| `{path}` | {kind} | `{default}` | {sub['description']} |")
    return "\n".join(rows)


def test_values_yaml_and_ci_values_match_the_schema():
    validator = jsonschema.Draft7Validator(load_schema())
    for path in [CHART / "values.yaml", *CI_VALUES]:
        errors = [e.message for e in validator.iter_errors(yaml.safe_load(path.read_text()))]
        assert not errors, f"{path.name}: {errors}"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for path, sub in leaves(load_schema()):
        assert sub.get("description"), f"{path} has no description"
        lookup(values, path)  # every key the schema knows has a default in values.yaml


def test_docs_values_reference_is_in_sync():
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    expected = values_reference()
    assert expected in docs, (
        "docs/kubernetes.md's values table differs from values.schema.json; it should read:\n" + expected
    )
