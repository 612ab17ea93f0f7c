"""LoRA adapters while serving, as the router's Admin service answers for them: an adapter is loaded on
every worker in view or on none, and unloaded from every worker that serves it.

    load(workers, request)     each worker reads and checks it; one refusal unloads it from the others
    unload(workers, name)      NOT_FOUND when no worker serves it
    placements(loads)          where each adapter is served and where it sits in a slot

A worker that joins later serves only `model.adapters` (its config): placement sends an adapter's
requests only to workers that list it (`router.placement.index`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import grpc
from tandem.v1 import worker_pb2, worker_pb2_grpc

from cluster.grpc_server import Refused

WorkerStubs = Mapping[str, worker_pb2_grpc.WorkerStub]  # by worker name
RUNTIME_LOADING_OFF = "loading adapters while serving is off (lora.runtime_loading)"
ADMIN_TIMEOUT_S = 60.0  # reading and checking an adapter, on every worker at once


async def load(workers: WorkerStubs, request: worker_pb2.LoadAdapterRequest, metadata: Sequence) -> list[str]:
    """The workers that loaded it (all of them); raises `Refused` with the first refusal, after taking it
    off the workers that did load it."""
    if not request.name or not request.path:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "an adapter needs a name and a path")
    if not workers:
        raise Refused(grpc.StatusCode.UNAVAILABLE, "no worker in view to load the adapter on")
    answers = await _each(workers, "LoadAdapter", request, metadata)
    loaded = [n for n, a in answers.items() if isinstance(a, worker_pb2.AdapterResult)]
    refused = [(n, a) for n, a in answers.items() if isinstance(a, grpc.RpcError)]
    if refused:
        undo = worker_pb2.UnloadAdapterRequest(name=request.name)
        await _each({n: workers[n] for n in loaded}, "UnloadAdapter", undo, metadata)
        name, error = refused[0]
        raise Refused(error.code(), f"{name}: {error.details()}")
    return sorted(loaded)


async def unload(workers: WorkerStubs, name: str, metadata: Sequence) -> list[str]:
    """The workers that unloaded it; `Refused` NOT_FOUND when none served it."""
    answers = await _each(workers, "UnloadAdapter", worker_pb2.UnloadAdapterRequest(name=name), metadata)
    unloaded = sorted(n for n, a in answers.items() if isinstance(a, worker_pb2.AdapterResult))
    if not unloaded:
        for worker, a in answers.items():
            if isinstance(a, grpc.RpcError) and a.code() != grpc.StatusCode.NOT_FOUND:
                raise Refused(a.code(), f"{worker}: {a.details()}")
        raise Refused(grpc.StatusCode.NOT_FOUND, f"no worker serves adapter {name!r}")
    return unloaded


def placements(loads: Mapping[str, worker_pb2.WorkerLoad]) -> worker_pb2.AdapterList:
    """Every adapter the workers report, with the workers serving it and those holding it in a slot."""
    found: dict[str, worker_pb2.AdapterPlacement] = {}
    for worker, load in sorted(loads.items()):
        for a in (a for a in load.adapters if not a.retiring):
            entry = found.setdefault(a.name, worker_pb2.AdapterPlacement(name=a.name, digest=a.digest))
            entry.workers.append(worker)
            if a.resident:
                entry.resident_on.append(worker)
    return worker_pb2.AdapterList(adapters=[found[n] for n in sorted(found)])


async def _each(workers: WorkerStubs, method: str, request: object, metadata: Sequence) -> dict[str, object]:
    """`method(request)` on every worker at once: each one's answer or the RpcError it raised."""
    names = list(workers)
    calls = [getattr(workers[n], method)(request, timeout=ADMIN_TIMEOUT_S, metadata=metadata) for n in names]
    answers = await asyncio.gather(*calls, return_exceptions=True)
    for answer in answers:
        if isinstance(answer, BaseException) and not isinstance(answer, grpc.RpcError):
            raise answer
    return dict(zip(names, answers, strict=True))
