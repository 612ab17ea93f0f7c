"""Tandem's cluster core: what every role shares, in four subpackages and a few top-level modules.

- `cluster.model`: the model itself (architecture, the forward pass over a paged KV cache, loading,
  tokenizer and chat template, quantisation, CPU kernels).
- `cluster.engine`: the engine core both workers share (requests and step plans, block manager,
  sampler, speculative proposers, model runner, compiled decode).
- `cluster.kv`: moving KV caches between processes (wire format, transport contract, `grpc`,
  `collective`, `local`).
- `cluster.pools`: Ray at the edge (actors, pool controllers, the autoscaling policy).

At the top: the config schema (`config`), traces and metrics (`telemetry`), serving-metric and SLO
definitions (`slo`), credentials (`auth`, `tls`), gRPC servers (`grpc_server`), the shell both
workers extend (`worker_shell`), the wedged-engine canary (`watchdog`), offline generation
(`generate`) and the commands that need no cluster (`cli`).
Imports nothing from the workers or the router; `tests/test_layering.py` holds each subpackage to
its layer.
"""
