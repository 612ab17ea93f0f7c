"""Tandem's configuration: one frozen pydantic model per part, composed by `ClusterConfig`.

Every field is described; the descriptions are the command-line and docs help. Each component
receives only its own part. Values measured at start-up (how many KV blocks fit, the model's
fingerprint) go into result objects, never back into the config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from cluster.cpu import auto_dtype

MAX_ADAPTER_NAME = 256  # characters of a LoRA adapter's name


class ConfigError(ValueError):
    """A config file that cannot be read or does not validate; the message names the field."""


class _Part(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())


class ModelConfig(_Part):
    path: Path = Field(
        description="Hugging Face model folder (config.json, *.safetensors, tokenizer.json), or a GGUF file, "
        "imported once into a folder under ~/.cache/tandem/gguf."
    )
    name: str | None = Field(default=None, description="Name clients use for the model; defaults to the folder's name.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description="Element type of weights, activations and the KV cache. auto: bfloat16 on a GPU and on a CPU "
        "that multiplies it natively (AVX512-BF16, AMX), else float32; decided where the config is read, so every "
        "worker of a cluster holds the same.",
    )
    device: Literal["cpu", "cuda"] = Field(default="cpu", description="Where the model runs.")
    generation_config: Literal["auto", "none"] = Field(
        default="auto",
        description="auto: a request that leaves temperature, top_p, top_k, min_p or repetition_penalty unset gets "
        "the model's own from its generation_config.json (tandem serve prints them); none: Tandem's defaults.",
    )
    max_model_len: int | None = Field(
        default=None,
        gt=0,
        description="Longest prompt + completion in tokens; defaults to the model's max_position_embeddings.",
    )
    seed: int = Field(default=0, description="Seed for weight-independent randomness (sampling defaults).")
    weight_dtype: Literal["auto", "int8", "int4"] = Field(
        default="auto",
        description="Weight-only quantisation of the linear layers at load (CPU): auto keeps dtype; int8 per output "
        "channel; int4 in groups of weight_group_size input columns. A folder Tandem wrote quantised loads as it is.",
    )
    weight_group_size: Literal[32, 64, 128, 256] = Field(
        default=128, description="With weight_dtype=int4: input columns sharing one scale and offset."
    )
    quantize_lm_head: bool = Field(
        default=True,
        description="With weight_dtype int8/int4: quantise the LM head too (a decode step reads it whole).",
    )
    prepack_weights: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="CPU: keep a second copy of the layers' weights (bfloat16, quantised ones dequantised) in "
        "oneDNN's layout for prompt products of more than 16 rows, 1.2-1.8x faster there, at the cost of that copy's "
        "memory. auto: bfloat16 models on a CPU with AMX tiles; on: wherever oneDNN runs the dtype; off: never.",
    )
    huge_pages: Literal["auto", "off"] = Field(
        default="auto",
        description="CPU: move the model's tensors, once at load, into memory Linux backs with 2 MB pages (its "
        "transparent huge pages, madvise or always); a decode step streams every weight, and through 4 KB pages it "
        "looks up a translation every 4 KB. auto: wherever the kernel offers them; off: where torch put them.",
    )
    compile_buckets: tuple[int, ...] = Field(
        default=(),
        description="Decode workers: row counts (sequences, plus draft tokens to verify) of the steps compiled with "
        "torch.compile before the worker serves, e.g. [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]; a step is padded to "
        "the next one. Seconds to minutes of start-up per bucket; empty: every step runs eager.",
    )
    adapters: dict[str, Path] = Field(
        default_factory=dict,
        description="LoRA adapters loaded at start, by the name requests use: {name: folder PEFT saved "
        "(adapter_config.json + adapter_model.safetensors)}. Limits in `lora`.",
    )

    @model_validator(mode="before")
    @classmethod
    def _resolve_auto_dtype(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("dtype", "auto") == "auto":
            data = {**data, "dtype": auto_dtype(str(data.get("device", "cpu")))[0]}
        return data

    @model_validator(mode="after")
    def _buckets_positive(self) -> ModelConfig:
        if any(b < 1 for b in self.compile_buckets):
            raise ValueError(f"compile_buckets must be positive, not {list(self.compile_buckets)}")
        return self

    @property
    def served_name(self) -> str:
        return self.name or self.path.name

    @model_validator(mode="after")
    def _adapter_names(self) -> ModelConfig:
        for name in self.adapters:
            if not name or len(name) > MAX_ADAPTER_NAME or name == self.served_name:
                raise ValueError(
                    f"adapters: {name!r} must be 1 to {MAX_ADAPTER_NAME} characters and not the model's own name"
                )
        return self


LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS: tuple[LoraTarget, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(_Part):
    max_loras: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Adapters resident on a worker at once, and so in one batch; the least recently used is "
        "written over. Each pass computes every slot's low-rank product, so a step's added cost grows with "
        "max_loras x max_rank.",
    )
    max_rank: int = Field(default=16, ge=1, le=512, description="Largest adapter rank a worker accepts.")
    targets: tuple[LoraTarget, ...] = Field(
        default=LORA_TARGETS,
        min_length=1,
        description="Projections an adapter may update; an adapter updating another is refused. Fewer "
        "targets, less memory and work per step.",
    )
    max_workers_per_adapter: int | None = Field(
        default=None,
        ge=1,
        description="Decode workers one adapter may sit in a slot on at once: once that many hold it, its requests "
        "go only to them, waiting there for room (its KV and its slot stay where they are); unset: no bound.",
    )
    runtime_loading: bool = Field(
        default=False,
        description="Allow loading and unloading adapters while serving (Admin.LoadAdapter / UnloadAdapter, "
        "`tandem adapters`, /v1/load_lora_adapter and /v1/unload_lora_adapter); off: only model.adapters.",
    )


class HostTierConfig(_Part):
    gib: float = Field(gt=0, description="Host memory for KV blocks beyond the pool, in GiB.")
    int8: bool = Field(
        default=False,
        description="Keep blocks as int8 with a float32 scale per (token, head) row: about half the bytes of "
        "bfloat16, a quarter of float32, so more fit; what loads back is that close, not equal (a pool with "
        "cache.kv_dtype int8 is int8 already).",
    )


class DiskTierConfig(_Part):
    path: Path = Field(description="Directory of the disk tier's files; a restarted worker finds its blocks there.")
    gib: float = Field(gt=0, description="Disk space for KV blocks, in GiB; the least recently used go first.")


class SharedTierConfig(_Part):
    url: str = Field(
        pattern=r"^rediss?://",
        description="The Redis every worker of the model reaches (redis://host:port/db; rediss:// for TLS). "
        "Redis bounds it (its own maxmemory and LRU policy); the cluster secret is its password.",
    )
    timeout_s: float = Field(default=0.5, gt=0, description="A Redis call slower than this is a failure.")
    ttl_s: float = Field(default=0, ge=0, description="Entries expire after this long; 0 keeps them until evicted.")
    tls_ca: Path | None = Field(
        default=None, description="With rediss://: the CA bundle that signs Redis's certificate; unset: the system's."
    )


class TiersConfig(_Part):
    host: HostTierConfig | None = Field(default=None, description="Blocks in host memory; unset: no host tier.")
    disk: DiskTierConfig | None = Field(default=None, description="Blocks in local files; unset: no disk tier.")
    shared: SharedTierConfig | None = Field(
        default=None, description="Blocks in a Redis shared by every worker of the model; unset: no shared tier."
    )
    write: Literal["evicted", "computed"] = Field(
        default="evicted",
        description="When a full block goes down the tiers: as the pool evicts it, or as soon as it is computed "
        "(written through: another worker can load a prefix this one still holds).",
    )
    retry_after_s: float = Field(
        default=5.0, gt=0, description="A tier whose store failed is off this long, then tried again."
    )

    @property
    def enabled(self) -> bool:
        return any((self.host, self.disk, self.shared))


class CacheConfig(_Part):
    block_size: int = Field(default=16, gt=0, le=1024, description="Tokens per KV-cache block.")
    memory_gib: float = Field(default=2.0, gt=0, description="Memory given to the KV cache on each worker, in GiB.")
    num_blocks: int | None = Field(
        default=None, gt=0, description="Exact number of KV blocks; overrides memory_gib when set."
    )
    watermark: float = Field(
        default=0.01,
        ge=0,
        lt=1,
        description="Share of blocks kept free at admission so running sequences can grow without thrashing.",
    )
    enable_prefix_caching: bool = Field(
        default=True, description="Share full KV blocks between requests with the same prompt prefix."
    )
    kv_dtype: Literal["auto", "int8", "float16", "bfloat16"] = Field(
        default="auto",
        description="KV cache element type: auto is the model's dtype; float16 and bfloat16 store a float32 "
        "model's KV in half the bytes (as llama.cpp's default float16 cache does); int8 stores each token's keys "
        "and values per head as int8 with a float32 scale (about half the bytes of bfloat16). Prefill and decode "
        "workers must agree.",
    )
    tiers: TiersConfig = Field(
        default_factory=TiersConfig,
        description="KV tiers under the pool: evicted blocks live on in host memory, on disk and in a shared "
        "Redis, and a prompt that misses the pool loads its longest run from them.",
    )


class SchedulerConfig(_Part):
    max_num_seqs: int = Field(default=64, gt=0, description="Most sequences in one running batch.")
    max_num_batched_tokens: int = Field(
        default=2048, gt=0, description="Most tokens (prompt chunks + decode tokens) in one forward pass."
    )
    long_prefill_chunk: int = Field(
        default=512,
        gt=0,
        description="Longest prompt chunk per step on a decode worker, so running decodes never stall long.",
    )
    prefill_apart: bool = Field(
        default=False,
        description="Decode workers: a step that would run prompt chunks (local prefill, a turn loaded from the KV "
        "tiers) beside running decode rows runs the chunks alone and the decode rows the step after, as SGLang "
        "schedules; off: one pass holds both, as vLLM's does.",
    )
    max_waiting: int = Field(
        default=256, gt=0, description="Most requests waiting on one worker; more get RESOURCE_EXHAUSTED at once."
    )
    wedged_after_s: float = Field(
        default=30.0,
        gt=0,
        description="A worker whose engine makes no progress this long while it holds work reports NOT_SERVING.",
    )
    engine_core: Literal["process", "thread"] = Field(
        default="process",
        description="Where a worker's engine steps (prefill and decode alike): a process of its own, whose GIL "
        "the gRPC front never takes (one frame per step between them), or a thread of the worker's own process.",
    )


class SpeculativeConfig(_Part):
    method: Literal["none", "ngram", "draft"] = Field(
        default="none",
        description="Speculative decoding on decode workers: off, prompt lookup (n-gram), or a draft model.",
    )
    num_tokens: int = Field(
        default=4, ge=1, le=16, description="Most tokens proposed per request per step (requests may ask for fewer)."
    )
    draft_model: Path | None = Field(
        default=None, description="With method=draft: folder of a small model with the served model's vocabulary."
    )
    draft_memory_gib: float = Field(default=0.25, gt=0, description="Memory for the draft model's KV cache, in GiB.")
    ngram_max: int = Field(default=4, ge=1, description="With method=ngram: longest suffix looked up in the context.")
    ngram_min: int = Field(default=2, ge=1, description="With method=ngram: shortest suffix looked up.")

    @model_validator(mode="after")
    def _method_needs(self) -> SpeculativeConfig:
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("method=draft needs draft_model")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) exceeds ngram_max ({self.ngram_max})")
        return self


class TransferConfig(_Part):
    transport: Literal["grpc", "collective", "local"] = Field(
        default="grpc", description="How prefill workers ship KV caches to decode workers."
    )
    layers_per_chunk: int = Field(default=1, gt=0, description="Layers carried by one transfer chunk.")
    layerwise: bool | None = Field(
        default=None,
        description="Ship each chunk of layers as soon as the forward pass finishes them, overlapping the "
        "transfer with the remaining layers' compute; false ships after the whole pass. Unset: on when the "
        "model runs on a GPU, off on CPU, where the transfer competes with the compute for the same cores "
        "(benchmarks/kv_transfer.py).",
    )
    max_queued_chunks: int = Field(
        default=8, gt=0, description="Chunks a transfer may queue before the sender waits (flow control)."
    )
    max_message_mib: int = Field(
        default=256, gt=0, description="gRPC message size limit for transfer streams, in MiB, on both ends."
    )
    max_groups: int = Field(
        default=8, gt=0, description="Most torch.distributed groups a worker keeps open (collective transport)."
    )
    timeout_s: float = Field(
        default=30.0, gt=0, description="A transfer not finished by then fails and frees its blocks."
    )
    lease_s: float = Field(
        default=60.0,
        gt=0,
        description="How long a prefill worker keeps a sent KV cache waiting for the decode worker's acknowledgement.",
    )


class AutoscalingConfig(_Part):
    min_replicas: int = Field(default=1, ge=0, description="Fewest workers in the pool.")
    max_replicas: int = Field(default=1, ge=1, description="Most workers in the pool.")
    upscale_delay_s: float = Field(
        default=30.0, ge=0, description="How long a signal must ask for more before scaling up."
    )
    downscale_delay_s: float = Field(
        default=300.0, ge=0, description="How long a signal must ask for fewer before scaling down."
    )
    max_step: int = Field(default=1, ge=1, description="Most replicas added or removed in one decision.")
    interval_s: float = Field(default=2.0, gt=0, description="How often the pool controller reads signals and decides.")
    target_queued_prompt_tokens: int = Field(
        default=4096, gt=0, description="Prefill pools: queued prompt tokens per worker the pool aims for."
    )
    target_running_seqs: int = Field(
        default=32, gt=0, description="Decode pools: running sequences per worker the pool aims for."
    )
    target_kv_cache_usage: float = Field(
        default=0.7, gt=0, le=1, description="Decode pools: share of each worker's KV cache in use the pool aims for."
    )
    drain_grace_s: float = Field(
        default=2.0, ge=0, description="A draining worker is stopped no sooner than this after it stopped taking work."
    )
    planned_replicas: int | None = Field(
        default=None,
        ge=0,
        description="The planner's target for this pool (`tandem plan`'s targets at the expected load): the pool "
        "grows to it at once and never shrinks below it; its signals may take it higher. None: signals only.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        return self


class PoolConfig(_Part):
    replicas: int = Field(default=1, ge=0, description="Workers started with the pool.")
    num_cpus: float = Field(default=1.0, ge=0, description="CPUs each worker actor reserves.")
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs each worker actor reserves.")
    resource: str | None = Field(
        default=None,
        description='Custom Ray resource each worker needs (e.g. "prefill"), marking the node group it runs on.',
    )
    placement_strategy: Literal["PACK", "SPREAD"] = Field(
        default="SPREAD",
        description="How Ray places the pool's workers: SPREAD across nodes, or PACK them onto as few as fit.",
    )
    autoscaling: AutoscalingConfig = Field(
        default_factory=AutoscalingConfig, description="Bounds and pace of the pool's autoscaler."
    )

    @model_validator(mode="after")
    def _replicas_in_bounds(self) -> PoolConfig:
        lo, hi = self.autoscaling.min_replicas, self.autoscaling.max_replicas
        if not lo <= self.replicas <= hi:
            raise ValueError(f"replicas ({self.replicas}) outside autoscaling bounds [{lo}, {hi}]")
        return self


class SLOConfig(_Part):
    ttft_s: float = Field(default=1.0, gt=0, description="Time-to-first-token target, seconds.")
    tpot_s: float = Field(default=0.1, gt=0, description="Time-per-output-token target, seconds.")
    window_s: float = Field(default=60.0, gt=0, description="Sliding window over which SLO attainment is computed.")


class TelemetryConfig(_Part):
    exporter: Literal["none", "console", "otlp-grpc", "otlp-http"] = Field(
        default="none",
        description="Where trace spans go: nowhere, the console (stderr, or files under console_dir), or an OTLP "
        "collector (needs the opentelemetry-exporter-otlp package).",
    )
    endpoint: str | None = Field(
        default=None, description="OTLP collector endpoint; unset uses the exporter's default."
    )
    console_dir: Path | None = Field(
        default=None, description="With exporter=console: write each process's spans as JSON lines to a file here."
    )
    sample_ratio: float = Field(default=1.0, ge=0, le=1, description="Share of requests traced (parent-based).")
    metrics_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="Port of the router's Prometheus /metrics endpoint (0 picks a free one); workers always pick "
        "free ports, which `tandem status` lists.",
    )


class AuthConfig(_Part):
    api_keys: tuple[SecretStr, ...] = Field(
        default=(), description="Keys clients present; empty (and no api_keys_file) disables client authentication."
    )
    api_keys_file: Path | None = Field(
        default=None, description="A file of client keys, one per line (a mounted Kubernetes secret, say)."
    )
    capability_ttl_s: float = Field(
        default=120.0, gt=0, description="How long a router-minted KV-transfer capability stays valid."
    )
    cluster_secret: SecretStr | None = Field(
        default=None,
        description="Shared secret on internal channels (router, workers, KV transfer); with it, every KV "
        "transfer must carry a router-minted capability. Unset leaves internal channels open.",
    )
    tls_cert: Path | None = Field(default=None, description="PEM certificate for TLS on the public port.")
    tls_key: Path | None = Field(default=None, description="PEM private key for tls_cert.")
    tls_ca: Path | None = Field(default=None, description="CA bundle for mutual TLS on internal channels.")

    @property
    def secret(self) -> str:
        """The cluster secret in clear; "" when unset."""
        return "" if self.cluster_secret is None else self.cluster_secret.get_secret_value()

    @model_validator(mode="after")
    def _tls_pair(self) -> AuthConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be set together")
        return self


class RayHAConfig(_Part):
    """Ray's GCS fault tolerance: the GCS keeps its tables in Redis, so one that restarts finds the
    registry, the pools and the workers again (docs/operations.md, "When Ray fails")."""

    fault_tolerant: bool = Field(
        default=False,
        description="The GCS of the Ray cluster at ray_address keeps its tables in Redis (the chart's rayHA, "
        "KubeRay's gcsFaultToleranceOptions): routers serve on while it restarts and wait for it. "
        "Set by redis_address.",
    )
    redis_address: str | None = Field(
        default=None,
        description='Redis ("host:port") where the GCS of the local Ray that `tandem serve` starts keeps its '
        "tables; serve starts a GCS that dies again. Unset: that GCS keeps them in memory only.",
    )
    redis_password: SecretStr | None = Field(
        default=None, description="That Redis's password; unset: TANDEM_RAY_REDIS_PASSWORD, else none."
    )
    reconnect_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="How long raylets and workers wait for a GCS that does not answer before they exit (Ray's "
        "gcs_rpc_server_reconnect_timeout_s; set, with 5 s more, on the Ray that `tandem serve` starts; read "
        "elsewhere). Without fault tolerance the workers are gone then: routers stop admitting before, so what is in "
        "flight finishes.",
    )
    drain_s: float = Field(
        default=15.0,
        ge=0,
        description="Without fault tolerance: how long before the raylets give up routers stop admitting "
        "requests, so those in flight finish while their workers live.",
    )

    @model_validator(mode="before")
    @classmethod
    def _redis_is_fault_tolerance(cls, data: Any) -> Any:
        address = data.get("redis_address") if isinstance(data, dict) else None
        if address is None:
            return data
        host, _, port = str(address).rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f'ray_ha.redis_address is "host:port", not {address!r}')
        return {**data, "fault_tolerant": True}


class RouterConfig(_Part):
    host: str = Field(default="127.0.0.1", description="Address the public gRPC server binds.")
    port: int = Field(default=50051, ge=0, le=65535, description="Public gRPC port (0 picks a free one).")
    replicas: int = Field(
        default=1,
        ge=1,
        description="Router processes `tandem serve` runs on host:port (its own and replicas - 1 `tandem router` "
        "processes sharing the port); each admits and keeps its SLO window on its own.",
    )
    http_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Port of the OpenAI-compatible HTTP face on router.host (0 picks a free one); unset: none.",
    )
    max_queued_requests: int = Field(
        default=256, gt=0, description="Requests waiting for a worker before new ones get RESOURCE_EXHAUSTED."
    )
    local_prefill_max_tokens: int = Field(
        default=64, ge=0, description="Prompts up to this many tokens are prefilled on the decode worker itself."
    )
    max_stop_strings: int = Field(default=16, ge=0, description="Most stop strings one request may carry.")
    migration_limit: int = Field(
        default=2, ge=0, description="Times a request may move to another worker after its worker dies mid-request."
    )
    shutdown_timeout_s: float = Field(
        default=60.0, ge=0, description="On SIGTERM, how long requests in flight may run before the router stops."
    )
    migration_wait_s: float = Field(
        default=60.0, ge=0, description="How long a migrating request waits for a live worker (a restart, say)."
    )
    ray_lost_after_s: float = Field(
        default=10.0,
        gt=0,
        description="How long Ray's GCS may not answer before the router counts it degraded: it serves on from "
        "the workers' own streams and refuses only what needs Ray (scaling); its health's \"tandem.ray\" service "
        "turns NOT_SERVING. What follows depends on ray_ha.",
    )
    prefix_routing: Literal["kv", "hash", "random"] = Field(
        default="kv",
        description="How placement finds a prompt's cached prefix: kv, from the workers' own cache events; "
        "hash, the prefill worker owning the prompt's first block on a consistent-hash ring; random, "
        "any worker (a baseline to compare against).",
    )
    prefix_index_max_blocks: int = Field(
        default=1_000_000, gt=0, description="Most KV blocks a router's prefix index tracks (about 180 bytes each)."
    )
    first_token_from_prefill: bool = Field(
        default=True,
        description="Stream a remotely prefilled request's first token as the prefill worker samples it, "
        "before its KV reaches the decode worker; false waits for the decode worker's first message.",
    )
    stream_interval: int = Field(
        default=1,
        ge=1,
        description="Tokens per message to the client after the first: the router holds a request's tokens "
        "until this many have come (or it finished), so each client message carries several steps; 1 sends "
        "each step's tokens as they come. The first token always goes at once.",
    )


class ClusterConfig(_Part):
    model: ModelConfig = Field(description="The served model.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Paged KV cache on each worker.")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="Batching limits.")
    transfer: TransferConfig = Field(default_factory=TransferConfig, description="KV transfer between pools.")
    speculative: SpeculativeConfig = Field(
        default_factory=SpeculativeConfig, description="Speculative decoding on decode workers."
    )
    prefill: PoolConfig = Field(default_factory=PoolConfig, description="The prefill worker pool.")
    decode: PoolConfig = Field(default_factory=PoolConfig, description="The decode worker pool.")
    slo: SLOConfig = Field(default_factory=SLOConfig, description="Latency targets.")
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig, description="Traces and metrics.")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="Credentials and TLS.")
    router: RouterConfig = Field(default_factory=RouterConfig, description="The front door.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters over the served model.")
    ray_address: str | None = Field(
        default=None, description='Ray cluster to join ("auto", "ray://host:port"); unset starts a local one.'
    )
    ray_ha: RayHAConfig = Field(default_factory=RayHAConfig, description="Fault tolerance of Ray's GCS (the Ray head).")

    @model_validator(mode="after")
    def _redis_is_for_a_local_head(self) -> ClusterConfig:
        if self.ray_ha.redis_address is not None and self.ray_address is not None:
            raise ValueError(
                "ray_ha.redis_address is for the local Ray that `tandem serve` starts; the Ray at ray_address "
                "keeps its GCS where its head says (KubeRay's gcsFaultToleranceOptions): set "
                "ray_ha.fault_tolerant instead"
            )
        return self

    @model_validator(mode="after")
    def _a_16_bit_cache_fits_the_model(self) -> ClusterConfig:
        kv, dtype = self.cache.kv_dtype, self.model.dtype  # model.dtype auto is resolved for this machine
        if kv in ("float16", "bfloat16") and dtype not in ("float32", kv):
            raise ValueError(
                f"cache.kv_dtype {kv} holds a float32 model's KV in 16 bits, and the model is {dtype} here "
                "(already 16-bit): use auto"
            )
        return self

    @model_validator(mode="after")
    def _sealed_tiers_have_a_secret(self) -> ClusterConfig:
        tiers = self.cache.tiers
        if (tiers.disk or tiers.shared) and self.auth.cluster_secret is None:
            raise ValueError(
                "cache.tiers.disk and cache.tiers.shared seal their entries with auth.cluster_secret: set it"
            )
        return self


def parse_config(data: Any, source: str = "config") -> ClusterConfig:
    """Validates a mapping into a `ClusterConfig`; errors name each bad field by its dotted path."""
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"invalid {source}:\n{_describe(e)}") from None


# The demo model that ships with the repository: what `tandem serve` runs when given no model.
BUNDLED_MODEL = Path(__file__).resolve().parents[1] / "models" / "tandem-demo-code"


def serve_config(config_path: str | Path | None = None, model: str | Path | None = None) -> ClusterConfig:
    """What `tandem serve` runs: the config file when given (its model replaced by `model` when that
    is given too), else every default around `model`, else the bundled demo model on a local Ray."""
    data: dict[str, Any] = json.loads(dump_config(load_config(config_path))) if config_path is not None else {}
    if model is not None or config_path is None:
        path = Path(model) if model is not None else BUNDLED_MODEL
        if not path.exists():
            raise ConfigError(f"no model at {path}: pass --model DIR or --config FILE")
        data["model"] = {**data.get("model", {}), "path": str(path), "name": None}
    return parse_config(data, source=str(config_path or "the default config"))


def load_config(path: str | Path) -> ClusterConfig:
    """Reads a YAML (`.yaml`, `.yml`) or JSON (`.json`) config file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return parse_config(data, source=str(path))


def _describe(error: ValidationError) -> str:
    lines = []
    for err in error.errors():
        where = ".".join(str(part) for part in err["loc"]) or "(top level)"
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)


def dump_config(config: ClusterConfig) -> str:
    """The config as JSON with its secrets in clear, for handing it to this cluster's own workers
    (pydantic's own JSON masks them). Not for logs."""

    def reveal(value: Any) -> Any:
        if isinstance(value, SecretStr):
            return value.get_secret_value()
        if isinstance(value, dict):
            return {k: reveal(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [reveal(v) for v in value]
        if isinstance(value, Path):
            return str(value)
        return value

    return json.dumps(reveal(config.model_dump(mode="python")))
