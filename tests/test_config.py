"""Config: frozen, closed, described; a bad field is named in the error."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest

from cli.main import main
from cluster import config as cfg
from cluster.config import ClusterConfig, ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]
PARTS = [
    cfg.ModelConfig,
    cfg.CacheConfig,
    cfg.SchedulerConfig,
    cfg.TransferConfig,
    cfg.AutoscalingConfig,
    cfg.PoolConfig,
    cfg.SLOConfig,
    cfg.AuthConfig,
    cfg.RouterConfig,
    cfg.ClusterConfig,
]


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.*")), ids=lambda p: p.name)
def test_examples_validate(path):
    config = load_config(path)
    assert isinstance(config, ClusterConfig)


@pytest.mark.parametrize("part", PARTS, ids=lambda p: p.__name__)
def test_every_part_is_frozen_closed_and_described(part):
    assert part.model_config["frozen"] and part.model_config["extra"] == "forbid"
    for name, field in part.model_fields.items():
        assert field.description, f"{part.__name__}.{name} has no description"


def test_defaults_and_freezing():
    c = parse_config({"model": {"path": "m"}})
    assert c.cache.block_size == 16 and c.transfer.transport == "grpc" and c.model.served_name == "m"
    with pytest.raises(pydantic.ValidationError):
        c.cache.block_size = 32  # type: ignore[misc]


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"model": {"path": "m"}, "cache": {"block_size": 0}}, "cache.block_size"),
        ({"model": {"path": "m"}, "cache": {"blok_size": 16}}, "cache.blok_size: Extra inputs are not permitted"),
        ({"model": {"path": "m", "dtype": "float16"}}, "model.dtype"),
        ({"model": {"path": "m"}, "transfer": {"transport": "rdma"}}, "transfer.transport"),
        ({"cache": {}}, "model: Field required"),
        (
            {"model": {"path": "m"}, "decode": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}},
            "decode.autoscaling: Value error, min_replicas (3) exceeds max_replicas (2)",
        ),
        ({"model": {"path": "m"}, "prefill": {"replicas": 5}}, "prefill: Value error, replicas (5) outside"),
        ({"model": {"path": "m"}, "auth": {"tls_cert": "c.pem"}}, "auth: Value error, tls_cert and tls_key"),
        ({"model": {"path": "m"}, "router": {"port": 70000}}, "router.port"),
        (
            {"model": {"path": "m", "dtype": "bfloat16"}, "cache": {"kv_dtype": "float16"}},
            "cache.kv_dtype float16 holds a float32 model's KV in 16 bits, and the model is bfloat16 here",
        ),
        ({"model": {"path": "m", "compile_buckets": [1, 0]}}, "model: Value error, compile_buckets must be positive"),
        ({"model": {"path": "m"}, "ray_ha": {"redis_address": "redis"}}, 'redis_address is "host:port"'),
        (
            {"model": {"path": "m"}, "ray_address": "auto", "ray_ha": {"redis_address": "10.0.0.9:6379"}},
            "ray_ha.redis_address is for the local Ray that `tandem serve` starts",
        ),
    ],
)
def test_bad_field_is_named(data, named):
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert named in str(e.value)


def test_bad_files(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(listed)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": {"path": "m"}, "slo": {"ttft_s": -1}}))
    with pytest.raises(ConfigError, match=r"bad\.json.*\n  slo\.ttft_s: Input should be greater than 0"):
        load_config(bad)


def test_secrets_do_not_print():
    c = parse_config({"model": {"path": "m"}, "auth": {"api_keys": ["hunter2"], "cluster_secret": "s3cret"}})
    assert "hunter2" not in repr(c) and "s3cret" not in repr(c)
    assert c.auth.api_keys[0].get_secret_value() == "hunter2"


def test_cli_config_check(tmp_path, capsys):
    assert main(["config", "check", str(ROOT / "examples" / "local.yaml")]) == 0
    assert "valid" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: m}\nscheduler: {max_num_seqs: -1}\n")
    assert main(["config", "check", str(bad)]) == 2
    assert "scheduler.max_num_seqs" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "device", "dtype"),
    [
        ({"avx2", "fma"}, "cpu", "float32"),  # Zen 3: bfloat16 products emulated
        ({"avx2", "avx512f", "avx512_vnni"}, "cpu", "float32"),  # AVX-512 without its bfloat16 pair products
        ({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}, "cpu", "bfloat16"),  # Zen 4
        ({"avx2", "avx512f", "amx_tile", "amx_bf16"}, "cpu", "bfloat16"),  # Xeon with AMX
        ({"avx2"}, "cuda", "bfloat16"),
        (set(), "cpu", "float32"),  # flags unreadable
    ],
)
def test_auto_dtype_is_bfloat16_only_where_it_is_multiplied_natively(monkeypatch, flags, device, dtype):
    from cli.serve import dtype_note
    from cluster import cpu

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    config = parse_config({"model": {"path": "m", "device": device}})
    assert config.model.dtype == dtype, "auto is the default"
    assert parse_config({"model": {"path": "m", "device": device, "dtype": "auto"}}).model.dtype == dtype
    other = "float32" if dtype == "bfloat16" else "bfloat16"
    assert parse_config({"model": {"path": "m", "device": device, "dtype": other}}).model.dtype == other
    # resolved where the config is read: what the workers get is the same dtype, whatever their CPU
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512_bf16"} - flags if dtype == "float32" else set()))
    assert ClusterConfig.model_validate_json(cfg.dump_config(config)).model.dtype == dtype
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    note = dtype_note(config)
    assert note.startswith(dtype) and ("natively" in note if dtype == "bfloat16" else "no native" in note)
    assert dtype_note(parse_config({"model": {"path": "m", "device": device, "dtype": other}})).endswith(
        "(as configured)"
    )


def test_this_machines_flags_name_its_kind():
    from cluster.cpu import cpu_flags, cpu_kind

    flags = cpu_flags()
    assert flags, "/proc/cpuinfo lists the CPU's flags"
    assert ("AVX-512" in cpu_kind()) == ("avx512f" in flags) and ("avx2" in flags or "neither" in cpu_kind())


@pytest.mark.parametrize(
    ("flags", "kind", "suffix"),
    [
        ({"avx2"}, "AVX2", "_avx2"),
        ({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}, "AVX-512 with VNNI and BF16", ""),
        ({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"}, "AVX-512 with VNNI, BF16 and AMX", "_amx"),
    ],
)
def test_each_kind_of_cpu_names_its_benchmark_files(monkeypatch, flags, kind, suffix):
    from cluster import cpu

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    assert (cpu.cpu_kind(), cpu.results_suffix()) == (kind, suffix)
