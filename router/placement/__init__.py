"""Which workers serve a request: the rule as pure functions of the prompt and the workers' loads
(`placement`, which the planner's simulator also reads, so it imports nothing but protobuf), the
same choices from an index the workers' pushed loads keep current (`index`) and from their KV
cache events (`prefix_index`), the workers the router can reach (`discovery`) and the `Watch`
streams that feed the index (`view`).
"""
