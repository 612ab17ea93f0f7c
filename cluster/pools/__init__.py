"""The pools on Ray: Ray stays at the edge, in this subpackage alone.

`ray_cluster` holds every Ray call (the registry, the pool controller and worker actors, local Ray
start-up); `controller` reconciles one pool toward its target (grow, drain, retire) through a
`WorkerOps` interface, so it is tested with a fake; `autoscaling` is the pure per-pool policy,
`decide(signals, state, now) -> decision`. The only subpackage of `cluster` that imports Ray.
"""
