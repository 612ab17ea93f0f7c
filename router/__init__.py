"""The router: the public gRPC service, validation, tokenisation, worker choice and the token stream;
and the client SDK, which imports only the generated stubs in `tandem.v1`, grpcio and protobuf.
"""
