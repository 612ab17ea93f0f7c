"""The prefill worker: batches prompts into compute-bound forward passes, samples the first token and
ships each prompt's KV cache to its decode worker (its scheduler, its engine, and the gRPC worker on
`cluster.worker_shell`). Imports `cluster`, never `decode_worker` or `router`.
"""
