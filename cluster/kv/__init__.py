"""KV transfer: how a prefill worker's KV cache reaches a decode worker.

`wire` is the versioned wire format (header with the model fingerprint, per-layer chunks with
checksums; pure functions); `transport` the small sender/receiver contract every transport
implements, with its explicit states, and the in-process `local` transport; `grpc_transport` the
client-streaming gRPC transport and the control side of `collective`; `collective` the
torch.distributed groups per prefill-decode pair (NCCL between GPUs, Gloo between CPUs). Imports
`cluster.model`, `cluster.engine` and the top-level `cluster` modules; no Ray.
"""
