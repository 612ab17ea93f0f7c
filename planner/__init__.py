"""Planning a deployment: what a machine costs, a simulated cluster at any size, and the P:D split.

`profile` is the cost model a machine was measured into (prefill by chunk and cached prefix, decode
steps by batch and context, KV transfer by bytes per transport, the router's costs) and its JSON
file; `measure` measures one (`tandem profile`, the one module here that imports torch). `workload`
draws arrivals and lengths. `sim` is the discrete-event simulator: the real decode and prefill
schedulers, block manager, placement rule and autoscaling policy under a simulated clock, with the
profile's costs in place of a model; `workers` are its simulated workers; `routing` is placement's
rule indexed for thousands of workers; `scaling` runs the real autoscaling policy on the simulated
pools; `report` turns the simulated requests into TTFT / TPOT / ITL / E2E, goodput and pool use.
`search` ranks layouts for `tandem plan`; `cli` adds `tandem profile` and `tandem plan`. Imports
`cluster`, the workers' schedulers and `router.placement.placement`; nothing in the cluster imports it.
"""
