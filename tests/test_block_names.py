"""Block names: what the pool, the KV events and the routers' prefix index call a full block. Two
prompts built to collide under the 64-bit hash blocks were once named by share nothing now; nor do
requests with different `cache_salt`s, in the pool or in routing; and a name covers every token
before its block, the model and the salt."""

from __future__ import annotations

from cluster.engine.block_manager import BlockManager
from cluster.engine.block_names import NAME_BYTES, UNNAMED_MODEL, Scope, chain, child, model_root, request_root
from cluster.engine.kv_events import KVJournal
from router.placement.prefix_index import PrefixIndex

BS = 16
# Built by a birthday search over CPython's tuple hash (xxHash-based, 64 bits): equal `hash()`, so
# equal names under the old scheme, `hash((parent, tuple(block)))`, for any parent. Every id is
# below 2048, a token of any vocabulary the project serves.
COLLIDING = (
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 682, 1772, 1156, 58, 393, 269],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 465, 1385, 1393, 1572, 63, 29],
)


def old_name(parent: int, block: list[int]) -> int:
    return hash((parent, tuple(block)))


def test_the_prompts_collide_under_the_old_hash_and_not_under_the_names():
    a, b = COLLIDING
    assert a != b and old_name(0, a) == old_name(0, b) and old_name(12345, a) == old_name(12345, b)
    assert chain(a, BS, UNNAMED_MODEL) != chain(b, BS, UNNAMED_MODEL)
    assert len(child(UNNAMED_MODEL, a)) == NAME_BYTES


def test_colliding_prompts_share_no_block_in_the_pool_or_in_routing():
    a, b = COLLIDING
    journal = KVJournal()
    pool = BlockManager(8, BS, journal=journal)
    pool.allocate("a", [*a, 7])
    pool.mark_computed("a", [*a, 7])
    pool.free("a")
    assert pool.can_allocate([*b, 7]) and pool.allocate("b", [*b, 7]) == 0, "b was served a's KV"
    pool.check_integrity()
    index = PrefixIndex()
    index.apply("decode-0", journal.since(None))
    (root,) = index.roots()
    assert index.match(chain(a, BS, root)) == {"decode-0": 1}
    assert index.match(chain(b, BS, root)) == {}, "the router would place b where a's KV is"


def test_requests_with_different_salts_share_no_block_and_equal_salts_do():
    prompt = list(range(100, 133))  # two full blocks and one token
    pool = BlockManager(16, BS, journal=(journal := KVJournal()))
    pool.allocate("tenant-a", prompt, scope=Scope("a"))
    pool.mark_computed("tenant-a", prompt)
    assert pool.allocate("unsalted", prompt) == 0
    assert pool.allocate("tenant-b", prompt, scope=Scope("b")) == 0
    assert pool.allocate("tenant-a again", prompt, scope=Scope("a")) == 32
    pool.check_integrity()
    index = PrefixIndex()
    index.apply("decode-0", journal.since(None))
    (salted,) = index.roots(Scope("a"))
    (other,) = index.roots(Scope("b"))
    assert index.match(chain(prompt, BS, salted)) == {"decode-0": 2}
    assert index.match(chain(prompt, BS, other)) == {}
    assert index.match(chain(prompt, BS, next(iter(index.roots())))) == {}


def test_a_name_covers_the_model_the_adapter_the_salt_and_every_token_before_its_block():
    block = list(range(16))
    root = model_root(b"weights")
    assert request_root(root) == root and request_root(root, Scope("")) == root
    adapter = bytes(range(32))
    names = {
        child(root, block),
        child(model_root(b"other weights"), block),
        child(request_root(root, Scope("a")), block),
        child(request_root(root, Scope("b")), block),
        child(request_root(root, Scope(adapter=adapter)), block),
        child(request_root(root, Scope(adapter=adapter[::-1])), block),
        child(request_root(root, Scope("a", adapter)), block),
        chain([99] * 16 + block, BS, root)[1],  # the same block after another one
    }
    assert len(names) == 8
    # Tagged, length-prefixed fields: a salt cannot pose as a model, an adapter as a salt, nor one
    # salt's split as another's
    assert request_root(root, Scope("ab")) != request_root(model_root(b"weights" + b"ab"))
    assert request_root(root, Scope(adapter=b"ab")) != request_root(root, Scope("ab"))
    assert chain([*block, *block], BS, root) == [child(root, block), child(child(root, block), block)]


def test_the_same_prompt_through_different_adapters_shares_no_block_in_the_pool_events_or_routing():
    prompt = list(range(200, 233))  # two full blocks and one token
    first, second = bytes(range(32)), bytes(range(1, 33))  # two adapters' digests
    pool = BlockManager(16, BS, journal=(journal := KVJournal()))
    scopes = {"through first": Scope(adapter=first), "base": Scope(), "through second": Scope(adapter=second)}
    scopes["salted, first"] = Scope("a", first)
    for seq, scope in scopes.items():
        assert pool.allocate(seq, prompt, scope=scope) == 0, f"{seq} was served another scope's KV"
        pool.mark_computed(seq, prompt)
    assert pool.allocate("first again", prompt, scope=Scope(adapter=first)) == 32
    pool.check_integrity()
    stored = [name for batch in [journal.since(None)] for name in batch.stored]
    assert len(stored) == len(set(stored)) == 8, "four scopes' two blocks each, every name apart"
    index = PrefixIndex()
    index.apply("decode-0", journal.since(None))
    (through_first,) = index.roots(Scope(adapter=first))
    (through_second,) = index.roots(Scope(adapter=second))
    assert index.match(chain(prompt, BS, through_first)) == {"decode-0": 2}
    assert index.match(chain(prompt, BS, through_second)) == {"decode-0": 2}
    assert chain(prompt, BS, through_first) != chain(prompt, BS, through_second)
