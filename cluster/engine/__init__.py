"""The engine core both workers share: a request's counted state, the plan of a step, and running it.

`request` holds `Request` (token ids, `num_computed_tokens` catching up with `num_tokens`),
`SamplingParams` and `StepPlan`; `block_manager` the paged KV blocks (ref counts, prefix hashes,
`check_integrity`); `sampler` the batched sampling and speculative acceptance rule; `speculative`
the n-gram and draft-model proposers; `model_runner` executes a plan on the model (one forward
pass, one sample per finished chunk); `compiled` holds the torch.compile'd decode graphs, one per
bucket of rows; `changes` the change counter an engine's loop and watchers wait on. Each worker's
scheduler lives with its worker. Imports `cluster.model` and the
top-level `cluster` modules: no `cluster.kv`, no `cluster.pools`, no gRPC, no Ray.
"""
