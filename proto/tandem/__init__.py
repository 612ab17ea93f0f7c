"""Tandem's wire contracts: the protobuf messages and gRPC stubs generated from `proto/`.

The client SDK imports only this package, grpcio and protobuf.
"""
