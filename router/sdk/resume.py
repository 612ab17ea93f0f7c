"""Retrying and resuming an SDK stream: UNAVAILABLE is tried again, from the start before the first
token and, after it, as the request again with `resume` (its id and the tokens and text received),
which any router continues from where the stream broke, nothing lost or repeated."""

from __future__ import annotations

import grpc
from tandem.v1 import api_pb2


def retryable(e: grpc.RpcError, attempt: int, retries: int) -> bool:
    """UNAVAILABLE (the router unreachable, or its connection reset) is tried again: from the
    start before the first token, as a resumption after it (`Received.request`)."""
    return e.code() is grpc.StatusCode.UNAVAILABLE and attempt < retries


class Received:
    """What a stream has delivered so far, to resume it through any router when it breaks."""

    def __init__(self, request: api_pb2.GenerateRequest) -> None:
        self.original, self.request_id, self.tokens = request, "", []
        self.texts: list[str] = []  # joined only when the stream resumes

    def add(self, m: api_pb2.GenerateResponse) -> None:
        self.request_id = self.request_id or m.request_id
        self.tokens += m.token_ids
        self.texts.append(m.text)

    def request(self) -> api_pb2.GenerateRequest:
        """The request to send (again): as it was, with `resume` once tokens have arrived."""
        if not self.tokens:
            return self.original
        resumed = api_pb2.GenerateRequest()
        resumed.CopyFrom(self.original)
        text = "".join(self.texts)
        resumed.resume.CopyFrom(api_pb2.Resume(request_id=self.request_id, token_ids=self.tokens, text=text))
        return resumed
