"""Tandem's client SDK: `client` (`Client`, `AsyncClient`) talks to a router over gRPC, with typed
structured-output constraints (`constraints`), the errors a call raises (`errors`) and the
resumption of a stream that broke (`resume`). It imports grpcio, protobuf and the generated
`tandem.v1` stubs only, so any Python program can use it.
"""
