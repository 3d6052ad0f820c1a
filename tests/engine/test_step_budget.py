"""A long prompt cannot stall the requests already streaming: while any request decodes, a step takes
decode rows first and only the prompt tokens that keep it within the target inter-token latency,
from step times measured as the engine runs (engine/step_budget.py). Step times here are synthetic
(a model of a slow machine fed to the budget), so no test depends on this machine's speed."""

from __future__ import annotations

from tokenmill import LLM, SamplingParams
from tokenmill.config import SchedulerConfig
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.step_budget import StepBudget
from tokenmill.kv_cache import KVCacheManager
from tokenmill.request import Request

# A slow machine: 40 ms a step (reading the weights, a decode row or two), 1 ms a prompt token on
# top (2,048 prompt tokens: ~2 s).
DECODE_S, TOKEN_S = 0.040, 0.001


def synthetic_seconds(prefill_tokens: int, decode_rows: int, token_s: float = TOKEN_S) -> float:
    return DECODE_S + token_s * prefill_tokens


def test_the_whole_budget_when_nothing_decodes():
    b = StepBudget(target_s=0.25, max_tokens=2048)
    assert b.prefill_tokens(decoding=False) == 2048
    b.observe(2048, 0, synthetic_seconds(2048, 0))
    assert b.prefill_tokens(decoding=False) == 2048
    assert StepBudget(target_s=0, max_tokens=2048).prefill_tokens(decoding=True) == 2048  # off


def test_while_decoding_prompt_tokens_fit_the_target():
    b = StepBudget(target_s=0.25, max_tokens=2048)
    assert b.prefill_tokens(decoding=True) == b.min_tokens  # nothing measured yet: the least
    b.observe(0, 1, synthetic_seconds(0, 1))
    b.observe(512, 0, synthetic_seconds(512, 0))  # a prompt alone: ~1 ms a token
    want = (0.25 - DECODE_S) / TOKEN_S
    assert 0.8 * want <= b.prefill_tokens(decoding=True) <= want
    # A step over the target (a costlier prompt: 4 ms a token) shrinks the next one at once.
    b.observe(200, 1, DECODE_S + 200 * 0.004)
    assert b.prefill_tokens(decoding=True) < 0.5 * want


def test_growth_is_at_most_2x_a_step():
    b = StepBudget(target_s=0.25, max_tokens=2048)
    b.observe(0, 1, synthetic_seconds(0, 1))
    seen = []
    for _ in range(8):
        n = b.prefill_tokens(decoding=True)
        seen.append(n)
        b.observe(n, 1, synthetic_seconds(n, 1) * 0.01)  # much faster than feared: grows, 2x at most
    assert seen[0] == b.min_tokens and all(y <= 2 * x for x, y in zip(seen, seen[1:]))
    assert seen[-1] > 8 * seen[0]


def test_decode_rows_go_first_and_the_prompt_gets_what_fits():
    kv = KVCacheManager(num_blocks=1024, block_size=16)
    # priority: the long prompt (priority 0) is served before the stream (priority 5) and so comes
    # first among the running requests; the stream's decode row still goes first in every step
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=8192, policy="priority", itl_target_ms=250
        ),
        kv,
    )
    short = Request("short", [1, 2, 3], SamplingParams(max_tokens=500), priority=5)
    sched.add_request(short)
    out = sched.schedule()
    sched.observe_step(out, synthetic_seconds(3, 0))
    sched.update(out, {"short": [7]})
    out = sched.schedule()  # decoding
    sched.observe_step(out, synthetic_seconds(0, 1))
    sched.update(out, {"short": [7]})
    long = Request("long", list(range(1, 6001)), SamplingParams(max_tokens=4), priority=0)
    sched.add_request(long)
    want = (0.25 - DECODE_S) / TOKEN_S
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens - 1:
        out = sched.schedule()
        rows = [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]
        assert rows[0] == ("short", 1) and out.num_decode_rows == 1
        chunks += [n for rid, n in rows if rid == "long"]
        seconds = synthetic_seconds(out.num_batched_tokens - 1, 1)
        assert seconds <= 0.25 + 1e-9
        sched.observe_step(out, seconds)
        sched.update(out, {"short": [7]} | ({"long": [8]} if out.scheduled[-1].samples else {}))
    assert sched.running[0] is long  # first in priority order, yet never ahead of the decode row
    assert len(chunks) > 6000 / want  # many small chunks, not three of 2,048
    assert max(chunks) <= want


def test_a_bystander_streams_between_the_chunks_of_a_long_prompt(tiny_llama_dir):
    """End to end on the engine: every step that runs part of the long prompt also gives the
    streaming request its next token, and the prompt goes in chunks that fit the target."""
    llm = LLM(tiny_llama_dir, dtype="float32", max_num_batched_tokens=2048, itl_target_ms=250)
    token_s = 0.005  # slower still: the tiny model's 512 positions make a few chunks
    engine, sched = llm.engine, llm.engine.core.scheduler
    budget = sched.step_budget

    def observe(out, seconds):  # the slow machine's step times, not this one's
        prefill = out.num_batched_tokens - out.num_decode_tokens
        budget.observe(prefill, out.num_decode_rows, synthetic_seconds(prefill, out.num_decode_rows, token_s))

    steps: list[dict[str, int]] = []
    schedule = sched.schedule

    def recording_schedule():
        out = schedule()
        steps.append({s.request.request_id: s.num_new_tokens for s in out.scheduled})
        return out

    sched.observe_step, sched.schedule = observe, recording_schedule
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    stream = engine.add_request(None, "Once upon a time", greedy)
    for _ in range(3):  # its prompt, then a couple of tokens
        engine.step()
    long_ids = [7 + i % 400 for i in range(400)]
    long = engine.add_request(None, long_ids, SamplingParams(temperature=0.0, max_tokens=1))
    first = len(steps)
    while long in sched.requests:
        engine.step()
    with_long = [s for s in steps[first:] if long in s]
    want = (0.25 - DECODE_S) / token_s
    assert len(with_long) >= len(long_ids) / want  # the prompt went in chunks
    assert all(s[long] <= want for s in with_long)
    assert all(s.get(stream) == 1 for s in with_long)  # the stream got a token in each of those steps
    engine.abort_request(stream)
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_usable_blocks


def test_a_server_sizes_prompt_tokens_offline_takes_the_whole_budget(tiny_llama_dir):
    from tokenmill.engine.async_engine import AsyncLLMEngine

    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.05)  # a batch: throughput first
    assert llm.engine.core.scheduler.step_budget.target_s == 0
    aengine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", kv_cache_memory=0.05)  # tokenmill serve's
    try:
        assert aengine.engine.core.scheduler.step_budget.target_s == 0.25
    finally:
        aengine.shutdown()
    off = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", kv_cache_memory=0.05, itl_target_ms=0)
    try:
        assert off.engine.core.scheduler.step_budget.target_s == 0
    finally:
        off.shutdown()
