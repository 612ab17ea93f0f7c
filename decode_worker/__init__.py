"""The decode worker: the paged KV block manager, the continuous-batching scheduler, the sampler and
the receiving end of KV transfer. Imports `cluster`, never `prefill_worker` or `router`.
"""
