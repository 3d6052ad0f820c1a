"""Automatic prefix caching: hashing, accounting, eviction, and same outputs with it on or off."""

from __future__ import annotations

import random

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.kv_cache import KVCacheManager, hash_block
from tokenmill.request import Request, RequestStatus

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _req(rid: str, ids: list[int], salt: str | None = None) -> Request:
    return Request(rid, ids, SamplingParams(max_tokens=4), cache_salt=salt)


def _run_prefill(kv: KVCacheManager, req: Request) -> int:
    """What the scheduler does for one waiting request whose prompt fits one step; returns hits."""
    computed = kv.get_computed_blocks(req)
    cached = len(computed) * kv.block_size
    assert kv.allocate_slots(req, req.num_tokens - cached, computed)
    kv.record_admission(req, cached)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    return cached


def _finish(kv: KVCacheManager, req: Request) -> None:
    req.status = RequestStatus.FINISHED_STOPPED
    kv.free(req)


def test_hash_is_chained_strong_and_keyed():
    a = hash_block(None, [1, 2, 3, 4])
    assert len(a) == 32  # SHA-256
    assert hash_block(None, [1, 2, 3, 4]) == a
    assert hash_block(a, [1, 2, 3, 4]) != a  # same tokens at another position
    assert hash_block(None, [1, 2, 3, 5]) != a
    assert hash_block(None, [1, 2, 3, 4], b"adapter-1") != a
    # No collisions over many random blocks, neighbours included (ids that differ in one bit).
    rng = random.Random(0)
    seen = {hash_block(None, [rng.randrange(1 << 20) for _ in range(16)]) for _ in range(20000)}
    seen |= {hash_block(None, [i] * 16) for i in range(5000)}
    assert len(seen) == 25000


def test_hits_misses_and_accounting():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    prefix = list(range(100, 112))  # 3 full blocks
    a = _req("a", prefix + [1, 2])
    assert _run_prefill(kv, a) == 0
    b = _req("b", prefix + [3, 4, 5])
    assert _run_prefill(kv, b) == 12  # the shared 3 blocks, while `a` still holds them
    assert kv.req_blocks["a"][:3] == kv.req_blocks["b"][:3]
    assert all(blk.ref_cnt == 2 for blk in kv.req_blocks["a"][:3])
    c = _req("c", [7] + prefix)  # same tokens, shifted: different chain, no hit
    assert _run_prefill(kv, c) == 0
    # The last prompt token is never served from cache, even when every block is cached.
    d = _req("d", prefix)
    assert _run_prefill(kv, d) == 8
    assert kv.stats.requests == 4
    assert kv.stats.queries == 14 + 15 + 13 + 12
    assert kv.stats.hits == 20
    assert kv.stats.hit_rate == pytest.approx(20 / 54)
    for r in (a, b, c, d):
        _finish(kv, r)
    assert kv.num_free_blocks == kv.num_usable_blocks
    # Freed blocks stay cached: a new request still hits them.
    assert _run_prefill(kv, _req("e", prefix + [9])) == 12


def test_reset_prefix_cache_forgets_free_and_used_blocks():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    prefix, other = list(range(100, 112)), list(range(200, 212))
    a = _req("a", prefix + [1])
    _run_prefill(kv, a)
    _finish(kv, a)  # its 3 full blocks are free and cached
    b = _req("b", other + [1])
    _run_prefill(kv, b)  # in use and cached
    hits = kv.stats.hits
    assert kv.reset_prefix_cache() == 6
    assert not kv.pool.cached and all(blk.block_hash is None for blk in kv.pool.blocks)
    assert len(kv.req_blocks["b"]) == 4  # b keeps its blocks
    c, d, e = _req("c", prefix + [2]), _req("d", other + [3]), _req("e", prefix + [4])
    assert _run_prefill(kv, c) == 0
    assert _run_prefill(kv, d) == 0  # b's blocks are no longer found either
    assert kv.stats.hits == hits  # cumulative: a reset does not rewind the counters
    assert _run_prefill(kv, e) == 12  # filled again by c
    kv.cache_blocks(b)  # b's blocks stay unnamed: they are not hashed a second time
    assert all(blk.block_hash is None for blk in kv.req_blocks["b"])
    for r in (b, c, d, e):
        _finish(kv, r)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_cache_salt_isolates():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    ids = list(range(20))
    assert _run_prefill(kv, _req("a", ids, salt="tenant-1")) == 0
    assert _run_prefill(kv, _req("b", ids, salt="tenant-2")) == 0
    assert _run_prefill(kv, _req("c", ids, salt="tenant-1")) == 16


def test_lru_eviction_order():
    kv = KVCacheManager(num_blocks=9, block_size=4)  # 8 usable blocks
    old = _req("old", list(range(0, 9)))  # 2 full blocks + 1 partial
    new = _req("new", list(range(50, 59)))
    for r in (old, new):
        _run_prefill(kv, r)
        _finish(kv, r)
    assert len(kv.pool.cached) == 4
    # 7 fresh blocks take the 2 never-used ones, then the least recently freed: all of `old`
    # (its tail first), `new`'s uncached partial block, then `new`'s second block: a request's
    # tail is evicted before its head, which more prompts share.
    _run_prefill(kv, _req("big", list(range(200, 228))))
    assert kv.get_computed_blocks(_req("old2", list(range(0, 9)))) == []
    assert len(kv.get_computed_blocks(_req("new2", list(range(50, 59))))) == 1


def test_hit_blocks_in_free_queue_count_against_capacity():
    kv = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable blocks
    a = _req("a", list(range(9)))
    _run_prefill(kv, a)  # 3 blocks
    _finish(kv, a)
    filler = _req("f", list(range(100, 104)))
    _run_prefill(kv, filler)  # takes the one never-used block
    b = _req("b", list(range(8)) + list(range(300, 310)))  # 2 hits + 10 tokens = 3 more blocks
    computed = kv.get_computed_blocks(b)
    assert len(computed) == 2
    # 2 hits sit in the free queue (3 free blocks in all): 2 + 3 new > 3 free.
    assert not kv.allocate_slots(b, b.num_tokens - 8, computed)
    assert all(blk.ref_cnt == 0 for blk in computed) and kv.block_ids("b") == []


def _shared_prefix_prompts(llm, n=6):
    tok = llm.get_tokenizer()
    system = tok.encode("You are a helpful assistant. Answer briefly and precisely. " * 4)
    return [system + tok.encode(f" Question {i}: what is {i} plus {i}?", add_special_tokens=False) for i in range(n)]


@pytest.mark.parametrize("chunk", [None, 8])
def test_same_outputs_with_and_without_caching(tiny_llama_dir, chunk):
    kw = dict(dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=chunk)
    on = LLM(tiny_llama_dir, **kw)
    off = LLM(tiny_llama_dir, enable_prefix_caching=False, **kw)
    prompts = _shared_prefix_prompts(on)
    # Twice: the second round hits blocks cached (and freed) by the first.
    for _ in range(2):
        a = on.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        b = off.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert off.engine.core.kv.stats.hits == 0 and not off.engine.core.kv.pool.cached
    bs = on.engine.config.cache.block_size
    assert on.engine.core.kv.stats.hits >= sum((len(p) - 1) // bs * bs for p in prompts)  # round 2 at least
    assert sum(o.num_cached_tokens for o in a) > 0 and all(o.num_cached_tokens == 0 for o in b)
    for llm in (on, off):
        assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_usable_blocks


def test_caching_with_constant_preemption(tiny_llama_dir):
    ref = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02, enable_prefix_caching=False)
    prompts = _shared_prefix_prompts(ref, n=5)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    # Few blocks: requests preempt each other and come back to find (part of) their blocks cached.
    llm = LLM(tiny_llama_dir, dtype="float32", num_gpu_blocks_override=80, block_size=4)
    llm.engine.core.runner.kv_cache[:, :, 4:] = float("nan")  # stale data is never read
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert llm.engine.core.kv.stats.hits > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_usable_blocks


def test_multi_turn_chat_reuses_the_earlier_turn(smollm2_llm):
    llm = smollm2_llm
    params = SamplingParams(temperature=0.0, max_tokens=40)
    convo = [{"role": "user", "content": "Name three colours of the rainbow, with a sentence on each."}]
    first = llm.chat(convo, params)[0]
    answer = first.outputs[0]
    convo += [
        {"role": "assistant", "content": answer.text},
        {"role": "user", "content": "And which of them is your favourite?"},
    ]
    second = llm.chat(convo, params)[0]
    bs = llm.engine.config.cache.block_size
    # Turn 2 repeats turn 1's prompt and answer: their blocks are served from cache, the
    # generated tokens' blocks included (beyond what the first prompt alone covers).
    assert second.num_cached_tokens >= (first.num_prompt_tokens // bs + 1) * bs
    assert second.num_cached_tokens > first.num_prompt_tokens + len(answer.token_ids) // 2
