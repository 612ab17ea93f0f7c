"""The router's OpenAI-compatible HTTP face: the FastAPI app (`app`) turns each completion into
`tandem.v1.Generate` calls on the router's own gRPC port; the request fields it honours, refuses
or ignores (`fields`), the body read into a request (`request`), structured output and tool calls
(`tools`) and the reply, whole or streamed (`response`) are pure modules beside it.
"""
