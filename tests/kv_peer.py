"""A prefill worker in its own process for the two-process collective test.

    python tests/kv_peer.py MODEL_FOLDER DECODE_TARGET < {"id": [prompt ids, max_tokens], ...}

Prefills every prompt (greedy), ships the KV over the collective transport (Gloo) to the decode
worker at DECODE_TARGET, waits for every transfer to be acknowledged, and prints the first tokens
as JSON. Exits non-zero if any transfer failed.
"""

from __future__ import annotations

import json
import os
import sys

from cluster.config import CacheConfig, SchedulerConfig, TransferConfig
from cluster.engine.request import SamplingParams
from cluster.kv.collective import CollectiveGroups
from cluster.kv.grpc_transport import CollectiveSender
from cluster.kv.transport import TransferState
from cluster.model.loader import load_model
from prefill_worker.engine import PrefillEngine


def main() -> int:
    folder, target = sys.argv[1], sys.argv[2]
    spec = json.load(sys.stdin)
    model = load_model(folder, "float32")
    groups = CollectiveGroups("cpu", timeout_s=20)
    sender = CollectiveSender(target, groups)
    cache = CacheConfig(block_size=4, num_blocks=200, watermark=0.0)
    engine = PrefillEngine(model, cache, SchedulerConfig(max_num_batched_tokens=32), TransferConfig(), 200)
    for rid, (prompt, max_tokens) in spec.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), sender)
    first, streams = {}, {}
    while engine.scheduler.has_work:
        for out in engine.step():
            first[out.request_id] = out.first_token
            streams[out.request_id] = out.transfer
    for rid, stream in streams.items():
        if stream.wait(60) is not TransferState.DONE:
            print(f"{rid}: {stream.error}", file=sys.stderr)
            return 1
    groups.close()
    print(json.dumps(first))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter teardown: the work is done and reported, and a Gloo group torn down
    # moments earlier can still be unwinding its threads, which once in a while ends the process in
    # std::terminate ("terminate called without an active exception") during teardown.
    os._exit(code)
