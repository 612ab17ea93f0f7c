"""The router, in four rooms: `service` (the public gRPC service and the request path, from
validation to the relayed token stream), `placement` (worker discovery, the workers' pushed view
and the choice of workers from it), `openai` (the OpenAI-compatible HTTP face over the gRPC
service) and `sdk` (the client, which imports only the generated stubs in `tandem.v1`, grpcio and
protobuf).
"""
