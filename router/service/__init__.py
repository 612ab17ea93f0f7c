"""The router's gRPC service and its request path: the `tandem.v1.Tandem` and `Admin` servers on
`grpc.aio` (`server`, `aio_server`), what the router is configured with (`settings`), a request's
validation and tokenisation (`validate`), its dispatch to workers and migration (`dispatch`) and the
stream relayed back to the client (`stream`); and the router among its replicas (`fleet`, the
registry membership, and `replicas`, the extra router processes `tandem serve` starts).
"""
