"""The decode worker: the continuous-batching scheduler, beam search, the engine that steps them
(and its asyncio front), the receiving end of KV transfers, and the gRPC worker on
`cluster.worker_shell`. The block manager, the sampler and the model runner it uses are
`cluster.engine`'s. Imports `cluster`, never `prefill_worker` or `router`.
"""
