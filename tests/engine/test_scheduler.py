"""Block pool and scheduler: no leaks, chunked prefill, preemption under a tiny KV pool."""

from __future__ import annotations

import pytest
from conftest import PROMPTS, reference_paged_decode

from tokenmill import LLM, SamplingParams
from tokenmill.config import SchedulerConfig
from tokenmill.engine.scheduler import Scheduler
from tokenmill.kv_cache import BlockPool, KVCacheManager
from tokenmill.request import Request, RequestStatus

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _assert_no_leak(llm):
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert not kv.req_blocks
    assert not llm.engine.core.scheduler.requests
    assert not llm.engine.output_processor.states


@pytest.fixture(scope="module")
def reference(tiny_llama_llm):
    ids = [tiny_llama_llm.get_tokenizer().encode(p) for p in PROMPTS]
    outs = tiny_llama_llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)
    return ids, [o.outputs[0].token_ids for o in outs]


def test_block_pool_lru_and_refcounts():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(2)
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    pool.free_blocks(list(reversed(a)))
    # Freed tail-first: a[1] is evicted before a[0].
    assert [blk.block_id for blk in pool.get_new_blocks(2)] == [a[1].block_id, a[0].block_id]
    pool.touch(b)  # a second reference
    pool.free_blocks(b)
    assert pool.num_free_blocks == 0
    pool.free_blocks(b)
    assert pool.num_free_blocks == 2
    assert pool.null_block.block_id == 0 and all(blk.block_id != 0 for blk in a + b)


def test_scheduler_budget_and_chunking_without_model():
    kv = KVCacheManager(num_blocks=65, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=10, max_model_len=128), kv)
    params = SamplingParams(max_tokens=4)
    reqs = [Request(str(i), list(range(1, 8)), params) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    # 7 tokens for the first, the remaining 3 of the budget to the second (a chunk).
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("0", 7), ("1", 3)]
    assert [s.samples for s in out.scheduled] == [True, False]
    sched.update(out, {"0": [5]})
    out = sched.schedule()
    # Running first: decode for 0, next chunk for 1; max_num_seqs keeps 2 waiting.
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("0", 1), ("1", 4)]
    assert len(sched.waiting) == 1
    sched.finish_request("0", RequestStatus.FINISHED_ABORTED)
    sched.finish_request("1", RequestStatus.FINISHED_ABORTED)
    sched.finish_request("2", RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_preemption_without_model_frees_latest():
    kv = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable blocks
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), kv)
    a = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=8))
    b = Request("b", [1, 2, 3, 4], SamplingParams(max_tokens=8))
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update(out, {"a": [9], "b": [9]})
    used = kv.num_usable_blocks - kv.num_free_blocks
    assert used == 2
    out = sched.schedule()  # both need a 2nd block: 4 used, fine
    sched.update(out, {"a": [9], "b": [9]})
    for _ in range(3):
        sched.update(sched.schedule(), {"a": [9], "b": [9]})
    out = sched.schedule()  # a needs a 3rd block: b (latest) is preempted
    assert out.preempted == [b] and b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.output_token_ids  # output kept
    assert sched.waiting[0] is b


def test_chunked_prefill_same_tokens(tiny_llama_dir, reference):
    ids, expected = reference
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=8)
    outs = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    _assert_no_leak(llm)


def test_constant_preemption_same_tokens(tiny_llama_dir, reference):
    ids, expected = reference
    # 8 usable blocks of 4 tokens: far less than 8 requests of ~30-60 tokens need at once.
    llm = LLM(tiny_llama_dir, dtype="float32", num_gpu_blocks_override=17, block_size=4)
    llm.engine.core.runner.kv_cache[:, :, 4:] = float("nan")  # stale data is never read
    outs = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)
    assert llm.engine.core.scheduler.num_preemptions > 10
    assert [o.outputs[0].token_ids for o in outs] == expected
    _assert_no_leak(llm)


def test_abort_frees_blocks(tiny_llama_llm):
    engine = tiny_llama_llm.engine
    rids = [engine.add_request(None, p, GREEDY) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    assert engine.core.kv.num_free_blocks < engine.core.kv.num_usable_blocks
    for rid in rids:
        out = engine.abort_request(rid)
        assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    _assert_no_leak(tiny_llama_llm)
    assert engine.step() == []


def test_stream_close_aborts(tiny_llama_llm):
    stream = tiny_llama_llm.stream("Hello world", GREEDY)
    first = next(stream)
    assert first.outputs[0].delta_token_ids
    stream.close()
    _assert_no_leak(tiny_llama_llm)


def test_request_larger_than_pool_rejected(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", num_gpu_blocks_override=5, block_size=4)
    with pytest.raises(ValueError, match="KV"):
        llm.generate("Hello world", SamplingParams(max_tokens=100))
    _assert_no_leak(llm)


def test_pure_torch_attention_fallback_same_tokens(tiny_llama_dir, reference, monkeypatch):
    monkeypatch.setenv("TOKENMILL_NO_CPP_KERNELS", "1")
    ids, expected = reference
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02)
    assert llm.engine.core.runner.attn.kernels is None
    # The pool is allocated uninitialised: stale NaNs in unwritten slots must never be read.
    llm.engine.core.runner.kv_cache[:, :, llm.engine.config.cache.block_size :] = float("nan")
    outs = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_cpp_kernel_matches_torch(tiny_llama_llm):
    import torch

    kernels = tiny_llama_llm.engine.core.runner.attn.kernels
    if kernels is None:
        pytest.skip("C++ kernels unavailable on this machine")
    torch.manual_seed(0)
    bs, H, Hkv, D, B = 16, 8, 2, 64, 5
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        k_cache = torch.randn(40 * bs, Hkv, D, dtype=dtype)
        v_cache = torch.randn(40 * bs, Hkv, D, dtype=dtype)
        lens = torch.tensor([1, 17, 33, 64, 5])
        tables = torch.randperm(39)[: B * 4].view(B, 4) + 1
        q = torch.randn(B, H, D, dtype=dtype)
        out = kernels.paged_decode(q, k_cache, v_cache, tables, lens, bs, D**-0.5)
        ref = reference_paged_decode(q, k_cache, v_cache, tables, lens, bs)
        for b in range(B):
            assert (out[b].float() - ref[b]).abs().max() < tol


def test_bf16_packed_linear_same_tokens(tiny_llama_dir, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    packed = LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_memory=0.01)
    monkeypatch.setenv("TOKENMILL_NO_PACKED_LINEAR", "1")
    plain = LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_memory=0.01)
    a = [o.outputs[0].token_ids for o in packed.generate(PROMPTS, params)]
    b = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    assert a == b


def test_kv_budget_too_small_for_one_request_refuses_to_start(tiny_llama_dir, caplog):
    # 0.0001 GiB of float32 KV for this model is 12 blocks = 192 tokens < max_model_len 512.
    with pytest.raises(
        ValueError, match=r"holds 192 tokens.*--kv-cache-memory to at least.*--max-model-len to at most 192"
    ):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.0001)
    with caplog.at_level("INFO", logger="tokenmill"):
        llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.0001, max_model_len=128)
    assert llm.engine.core.kv.num_usable_blocks == 12
    assert "12 blocks x 16 tokens = 192 tokens" in caplog.text
    assert "max concurrency at max_model_len 128: 1.50x" in caplog.text


# ---- --scheduling-policy priority -------------------------------------------------------
def _policy_scheduler(policy: str, num_blocks: int = 65, max_num_seqs: int = 8) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4)
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64, policy=policy), kv
    )


def _req(rid: str, priority: int, arrival: float, max_tokens: int = 2) -> Request:
    return Request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens), priority=priority, arrival_time=arrival)


def _step(sched: Scheduler):
    out = sched.schedule()
    sched.update(out, {s.request.request_id: [9] for s in out.scheduled if s.samples})
    return out


@pytest.mark.parametrize("policy, expected", [("priority", ["b", "d", "c", "a"]), ("fcfs", ["a", "b", "c", "d"])])
def test_priority_policy_admits_lower_value_first_ties_by_arrival(policy, expected):
    sched = _policy_scheduler(policy, max_num_seqs=1)  # one at a time: admission order is run order
    for i, (rid, prio) in enumerate([("a", 5), ("b", 1), ("c", 3), ("d", 1)]):
        sched.add_request(_req(rid, prio, arrival=float(i)))
    order = []
    for _ in range(50):
        if not sched.has_unfinished():
            break
        for s in _step(sched).scheduled:
            if s.request.request_id not in order:
                order.append(s.request.request_id)
    assert order == expected and not sched.has_unfinished()
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_priority_policy_preempts_lowest_priority_running_request(policy):
    sched = _policy_scheduler(policy, num_blocks=5, max_num_seqs=2)  # 4 usable blocks of 4 tokens
    low = _req("low", priority=10, arrival=0.0, max_tokens=8)  # arrived first, lowest priority
    high = _req("high", priority=0, arrival=1.0, max_tokens=8)
    mid = _req("mid", priority=5, arrival=2.0, max_tokens=8)
    sched.add_request(low)
    sched.add_request(high)
    preempted = _step(sched).preempted  # both admitted
    sched.add_request(mid)  # waits: max_num_seqs is 2
    for _ in range(5):  # prompts + 4 tokens each fill 2 blocks each; the 9th token needs a third
        preempted += _step(sched).preempted
    if policy == "priority":
        # The lowest priority goes, although it arrived first; it waits behind the higher-priority `mid`.
        assert preempted == [low] and low.num_computed_tokens == 0 and low.output_token_ids
        assert list(sched.waiting) == [mid, low]
    else:
        assert preempted == [high]  # FCFS: the latest-arrived running request
        assert list(sched.waiting) == [high, mid]
    for rid in ("low", "high", "mid"):
        sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks


def test_priority_policy_same_tokens_under_preemption(tiny_llama_dir, reference):
    ids, expected = reference
    # 8 usable blocks of 4 tokens: constant preemption; priorities opposite to arrival order.
    llm = LLM(tiny_llama_dir, dtype="float32", num_gpu_blocks_override=17, block_size=4, scheduling_policy="priority")
    prios = list(range(len(ids)))[::-1]
    outs = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, priority=prios)
    assert [o.outputs[0].token_ids for o in outs] == expected  # in input order
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert outs[prios.index(0)].metrics.num_preemptions == 0  # the most urgent is never the victim
    _assert_no_leak(llm)
    # Run one at a time, requests finish in priority order.
    llm1 = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02, max_num_seqs=1, scheduling_policy="priority")
    engine = llm1.engine
    for i, (p, prio) in enumerate(zip(ids[:4], [2, 0, 3, 1])):
        engine.enqueue(engine.make_request(p, GREEDY, f"r{i}", priority=prio))
    finished = []
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["r1", "r3", "r0", "r2"]


def test_priority_refused_under_fcfs(tiny_llama_llm):
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        tiny_llama_llm.generate("Hello", GREEDY, priority=[1])
    tiny_llama_llm.generate("Hello", SamplingParams(max_tokens=2), priority=0)  # 0 is every request's default
    _assert_no_leak(tiny_llama_llm)
