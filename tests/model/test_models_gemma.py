"""Gemma 2 / Gemma 3 (text) and sliding-window attention, against transformers.

Tiny random checkpoints (tests/tiny_models.py) whose sliding window (8 keys) is shorter than the
prompts, so the window changes the tokens (checked). Gemma 2 runs transformers' eager attention
(its default: SDPA has no soft-capping), Gemma 3 SDPA (equal to eager there). A Mistral-style
model whose every layer is windowed has its out-of-window KV blocks freed as it runs; the prefix
cache serves them again, correctly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hf_oracle import greedy, hf_attention, hf_greedy, load_hf, matching_prefix
from tiny_models import build_tiny_gemma, build_tiny_model

from tokenmill import LLM, SamplingParams
from tokenmill.model.layers.attention import LayerAttention, kv_window

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Paged attention keeps the KV cache in fixed-size blocks.",
    "Continuous batching admits new requests every step. Hello world! This is a tiny tokenizer for tests.",
    "def add(a, b):\n    return a + b\n\nThe quick brown fox",
    "Les élèves étudient à l'école. Über café naïve façade — 東京 北京 😀 🚀 1234567890 + - * / = ( ) [ ]",
    "Hello world! The quick brown fox jumps over { } < > ? ! , . ; : 東京 北京",
]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def _prompt_ids(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.encode(p) for p in PROMPTS]


def _check(outs, expected) -> None:
    """Greedy tokens equal the oracle's (up to a near-tie), logprobs within 1e-3."""
    for out, exp in zip(outs, expected):
        n = matching_prefix(list(out.outputs[0].token_ids), exp)
        got = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs[:n]]
        assert max(abs(a - b) for a, b in zip(got, exp[1])) < 1e-3


@pytest.fixture(scope="module")
def gemmas(tmp_path_factory) -> dict[int, tuple]:
    """Per Gemma version: (model dir, prompt ids, transformers' greedy run of each prompt)."""
    out = {}
    for version in (2, 3):
        path = str(build_tiny_gemma(tmp_path_factory.mktemp(f"tiny-gemma{version}"), version))
        ids = _prompt_ids(path)
        assert min(len(p) for p in ids) > 16, "prompts longer than the window, twice over"
        out[version] = path, ids, [hf_greedy(path, p, MAX_TOKENS) for p in ids]
    return out


@pytest.fixture(params=[2, 3], ids=["gemma2", "gemma3"])
def gemma(request, gemmas):
    return gemmas[request.param]


def test_the_window_and_softcaps_change_the_tokens(gemma):
    """Without the window (or Gemma 2's attention soft-cap) transformers gives other tokens, without
    the final soft-cap other logprobs (it is monotonic): the tests below would fail without them."""
    from transformers import AutoModelForCausalLM

    path, ids, expected = gemma
    changes = {"sliding_window": 4096}
    if load_hf(path).config.model_type == "gemma2":
        changes.update(attn_logit_softcapping=None, final_logit_softcapping=None)
    for key, value in changes.items():
        other = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, **hf_attention(path), **{key: value}
        ).eval()
        runs = (greedy(other, p, MAX_TOKENS) for p in ids)
        if key == "final_logit_softcapping":
            r, e = next(runs), expected[0]
            assert r[0] == e[0] and max(abs(a - b) for a, b in zip(r[1], e[1])) > 0.1
        else:
            assert any(r[0] != e[0] for r, e in zip(runs, expected)), key


def test_matches_hf_alone_batched_chunked_and_preempted(gemma):
    path, ids, expected = gemma
    llm = LLM(path, dtype="float32", kv_cache_memory=0.02)
    core = llm.engine.core
    assert core.kv.sliding_window is None  # global layers read every key
    assert core.runner.fast_decode is None or core.runner.device.type == "cuda"  # no fused CPU step; CUDA graphs
    assert [p[0] for p in core.runner.attn.params] == [
        8 if "sliding" in t else 0 for t in load_hf(path).config.layer_types
    ]
    for p, exp in zip(ids, expected):
        _check(llm.generate(prompt_token_ids=[p], sampling_params=GREEDY, use_tqdm=False), [exp])
    _check(llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False), expected)
    # 8-token prompt chunks and a pool of 15 blocks of 4 tokens: requests preempt each other.
    tight = LLM(path, dtype="float32", block_size=4, num_gpu_blocks_override=16, max_num_batched_tokens=8)
    _check(tight.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False), expected)
    assert tight.engine.core.scheduler.num_preemptions > 0
    for engine in (llm, tight):
        kv = engine.engine.core.kv
        assert kv.num_free_blocks == kv.num_usable_blocks


def test_torch_attention_fallback_matches_hf(gemma, monkeypatch):
    monkeypatch.setenv("TOKENMILL_NO_CPP_KERNELS", "1")
    path, ids, expected = gemma
    llm = LLM(path, dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=16)
    assert llm.engine.core.runner.attn.kernels is None
    _check(llm.generate(prompt_token_ids=ids[:3], sampling_params=GREEDY, use_tqdm=False), expected[:3])


def test_bf16_chunking_changes_no_bit(gemma):
    """bf16, batch-invariant (every row through the rows kernel, windows and caps included): a
    prompt run whole or in 5-token chunks gives the same logprobs, bit for bit."""
    path, ids, _ = gemma
    runs = []
    for chunk in (None, 5):
        llm = LLM(
            path, dtype="bfloat16", kv_cache_memory=0.02, max_num_batched_tokens=chunk, enable_prefix_caching=False
        )
        if llm.engine.core.runner.device.type != "cpu":
            pytest.skip("batch invariance is the CPU kernels' property")
        assert llm.engine.core.runner.attn.batch_invariant
        outs = llm.generate(prompt_token_ids=ids[:2], sampling_params=GREEDY, use_tqdm=False)
        runs.append(
            [(o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]) for o in outs]
        )
    assert runs[0] == runs[1]


@pytest.mark.parametrize("version", [2, 3], ids=["gemma2", "gemma3"])
def test_gguf_file_matches_hf(version, tmp_path, monkeypatch):
    """A GGUF written as llama.cpp's converter does (norms stored as 1 + w; what llama.cpp fixes
    itself as it does: every 2nd / 6th layer global, queries scaled by head_dim ** -0.5) converts
    to a folder transformers reads as the original, and the engine on the .gguf file gives
    transformers' tokens."""
    from gguf_writer import write_gguf_from_hf
    from transformers import AutoModelForCausalLM

    from tokenmill.model.gguf_loader import gguf_to_hf_folder

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    extra = dict(query_pre_attn_scalar=16) | ({} if version == 2 else dict(num_hidden_layers=6, layer_types=None))
    hf_dir = str(build_tiny_gemma(tmp_path / "hf", version, **extra))
    gguf_file = write_gguf_from_hf(hf_dir, tmp_path / f"gemma{version}.gguf")
    ref, conv = (
        AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        for d in (hf_dir, gguf_to_hf_folder(str(gguf_file)))
    )
    assert conv.config.layer_types == ref.config.layer_types and type(conv) is type(ref)
    ids = torch.randint(0, ref.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(conv(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)
    prompts = _prompt_ids(hf_dir)[:3]
    llm = LLM(str(gguf_file), dtype="float32", kv_cache_memory=0.02)
    _check(
        llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False),
        [hf_greedy(hf_dir, p, MAX_TOKENS) for p in prompts],
    )


# ---- a model whose every layer is windowed: KV blocks freed as it runs --------------------------------


@pytest.fixture(scope="module")
def sliding_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-mistral-window"), "mistral", sliding_window=12))


def _held(kv, rid: str) -> int:
    return sum(b is not kv.pool.null_block for b in kv.req_blocks.get(rid, ()))


def _run_held(engine, prompt: list[int]):
    """Greedy 40 tokens of one request, stepped by hand: (its last output, blocks it held after
    each step)."""
    kv = engine.core.kv
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    rid = engine.add_request(None, prompt, params)
    held, out = [], None
    for _ in range(200):  # bounded: the prompt's steps, then 39 decode steps
        for o in engine.step():
            out = o
        held.append(_held(kv, rid))
        if out is not None and out.finished:
            break
    return out, held


def test_all_sliding_model_frees_out_of_window_blocks(sliding_dir):
    llm = LLM(sliding_dir, dtype="float32", block_size=4, kv_cache_memory=0.02)
    engine, kv = llm.engine, llm.engine.core.kv
    assert kv.sliding_window == 12 and engine.core.runner.attn.params[0][0] == 12
    ids = _prompt_ids(sliding_dir)
    prompt = ids[0] + ids[1]
    out, held = _run_held(engine, prompt)
    exp = hf_greedy(sliding_dir, prompt, 40)
    matching_prefix(list(out.outputs[0].token_ids), exp)
    total = -(-(len(prompt) + 40) // 4)
    # Decoding, the request holds the blocks of its window (11 keys before the query) and the query's.
    assert max(held[-30:]) <= -(-11 // 4) + 2 < total
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_all_sliding_model_admits_requests_longer_than_its_kv_cache(sliding_dir):
    """Admission counts the blocks a request holds at once: with every layer windowed (12 keys)
    and 16-token steps, 10 usable blocks (40 tokens) hold one request of any length (the blocks
    of 11 keys before a step's first query and of the step's 16). Such a cache starts with
    max_model_len 128 and serves a 70-token request as transformers does; without chunked
    prefill (a whole prompt in one step) the same cache is refused."""
    probe = LLM(sliding_dir, dtype="float32", block_size=4, num_gpu_blocks_override=64)
    block_bytes = probe.engine.config.model.kv_bytes_per_token() * 4
    del probe
    need = -(-(12 - 1 + 16) // 4) + 1  # 8 blocks: the window's 11 keys and a step's 16 tokens
    assert need == 8
    gib = 11 * block_bytes / 2**30  # 10 usable blocks and the null block
    with pytest.raises(ValueError, match="holds 40 tokens of KV cache"):
        LLM(
            sliding_dir,
            dtype="float32",
            block_size=4,
            kv_cache_memory=gib,
            max_model_len=128,
            enable_chunked_prefill=False,
            max_num_batched_tokens=128,
        )
    llm = LLM(
        sliding_dir, dtype="float32", block_size=4, kv_cache_memory=gib, max_model_len=128, max_num_batched_tokens=16
    )
    engine, kv = llm.engine, llm.engine.core.kv
    assert kv.num_usable_blocks == 10 and kv.max_blocks_held(128, 16) == need
    ids = _prompt_ids(sliding_dir)
    prompt = (ids[0] + ids[1] + ids[2])[:30]
    out, held = _run_held(engine, prompt)  # 70 tokens: 18 blocks, were it to keep them all
    assert out is not None and out.finished and len(out.outputs[0].token_ids) == 40
    matching_prefix(list(out.outputs[0].token_ids), hf_greedy(sliding_dir, prompt, 40))
    assert max(held) <= need
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_prefix_cache_serves_freed_blocks_correctly(sliding_dir):
    """Blocks freed out of a running request's window stay cached under their hash: a longer
    prompt over the same prefix takes those of its first query's window (the earlier ones become
    null entries, even after they are evicted) and gives transformers' tokens."""
    from tokenmill.kv_cache import hash_block

    llm = LLM(sliding_dir, dtype="float32", block_size=4, num_gpu_blocks_override=100)
    kv = llm.engine.core.kv
    ids = _prompt_ids(sliding_dir)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0)
    first = llm.generate(prompt_token_ids=[ids[0]], sampling_params=params, use_tqdm=False)[0]
    longer = ids[0] + list(first.outputs[0].token_ids) + ids[2]
    expected = hf_greedy(sliding_dir, longer, 30)
    chain = [None]
    for i in range(len(longer) // 4):
        chain.append(hash_block(chain[-1], longer[4 * i : 4 * i + 4]))
    for round_ in range(3):
        if round_ == 1:  # other requests in between (the pool has room: they take never-used blocks)
            llm.generate(prompt_token_ids=[ids[3], ids[4]], sampling_params=params, use_tqdm=False)
        if round_ == 2:  # the prefix's first blocks evicted (allocations take the oldest free blocks first)
            for h in chain[1:4]:
                kv.pool.cached.pop(h, None)
        out = llm.generate(prompt_token_ids=[longer], sampling_params=params, use_tqdm=False)[0]
        assert out.num_cached_tokens >= len(ids[0]), round_
        _check([out], [expected])
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_window_hits_need_only_the_window():
    """KVCacheManager alone: a hit of k blocks needs blocks skippable(k * bs) .. k - 1 cached."""
    from tokenmill.kv_cache import KVCacheManager
    from tokenmill.request import Request

    kv = KVCacheManager(32, 4, sliding_window=6)
    req = Request("a", list(range(40)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(req, 40)
    req.num_computed_tokens = 40
    kv.cache_blocks(req)
    kv.free(req)
    hashes = kv._hashes(req, 9)
    kv.pool.cached.pop(hashes[0])  # evicted: a plain prefix cache would now hit nothing
    other = Request("b", list(range(40)), SamplingParams(max_tokens=1))
    hits = kv.get_computed_blocks(other)  # 9 blocks (the last prompt token is never served)
    assert len(hits) == 9 and kv.skippable(36) == 7
    assert all(b is kv.pool.null_block for b in hits[:7]) and all(b is not kv.pool.null_block for b in hits[7:])
    kv.pool.cached.pop(hashes[7])  # a block the 9-block hit's window reads: the hit shrinks
    assert len(kv.get_computed_blocks(other)) < 9
    assert kv_window([LayerAttention(4), LayerAttention(6)]) == 6
    assert kv_window([LayerAttention(4), LayerAttention()]) is None


# ---- the Triton backend (interpreted on the CPU) -----------------------------------------------------


def _triton_tokens(paths: list[str]) -> dict[str, list[list[int]]]:
    out = {}
    for path in paths:
        llm = LLM(path, dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=16)
        assert type(llm.engine.core.runner.attn).__name__ == "TritonAttentionBackend"
        res = llm.generate(
            prompt_token_ids=_prompt_ids(path)[:1],
            sampling_params=SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
            use_tqdm=False,
        )
        out[path] = [list(r.outputs[0].token_ids) for r in res]
    return out


if __name__ == "__main__":  # the child of the test below: TRITON_INTERPRET=1 set before triton's import
    print("RESULT " + json.dumps(_triton_tokens(sys.argv[1:])))


@pytest.mark.timeout(600)
def test_triton_backend_windows_and_caps(gemmas, sliding_dir, triton_interpreter):
    """The Triton kernels (interpreted) in the engine: both Gemmas and the all-sliding model give
    transformers' tokens with 16-token prompt chunks (a prompt of 20+ tokens: two chunks)."""
    paths = [gemmas[2][0], gemmas[3][0], sliding_dir]
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "TOKENMILL_ATTENTION_BACKEND": "triton",
        # the child imports the helpers in tests/ (pytest's pythonpath), not its own folder only
        "PYTHONPATH": os.pathsep.join(
            filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH")])
        ),
    }
    r = subprocess.run([sys.executable, __file__, *paths], env=env, capture_output=True, text=True, timeout=580)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.split("RESULT ", 1)[1])
    for path in paths:
        for toks, p in zip(got[path], _prompt_ids(path)):
            matching_prefix(toks, hf_greedy(path, p, 10))
