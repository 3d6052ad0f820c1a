"""Multi-LoRA in the engine: adapters made with peft on the tiny random models (and SmolLM2),
checked against transformers + peft (float32), mixed in one batch, with the scheduler's features."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import greedy, load_hf, matching_prefix
from lora_adapters import make_adapter, peft_model
from tiny_models import build_tiny_model

pytest.importorskip("peft")

from tokenmill import LLM, LoRARequest, SamplingParams  # noqa: E402
from tokenmill.lora.adapter import LoRAError  # noqa: E402

PROMPTS = [
    "Hello world, the quick",
    "def add(a, b):",
    "Paged attention keeps the KV cache",
    "Continuous batching admits new requests every step.",
]
N = 10


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """Four adapters on the tiny Llama: ranks 8 and 16, different target modules, rsLoRA, per-module alpha."""
    root = tmp_path_factory.mktemp("lora")
    return {
        "all8": make_adapter(tiny_llama_dir, root / "all8", rank=8, seed=1),
        "qvd16": make_adapter(
            tiny_llama_dir, root / "qvd16", rank=16, targets=["q_proj", "v_proj", "down_proj"], seed=2
        ),
        "mlp8rs": make_adapter(
            tiny_llama_dir,
            root / "mlp8rs",
            rank=8,
            targets=["gate_proj", "up_proj", "down_proj"],
            seed=3,
            use_rslora=True,
        ),
        "attn16": make_adapter(
            tiny_llama_dir, root / "attn16", rank=16, targets=["k_proj", "o_proj"], seed=4, alpha_pattern={"o_proj": 4}
        ),
    }


@pytest.fixture(scope="module")
def lora_llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02, enable_lora=True, max_loras=4, max_lora_rank=16)


def _requests(adapters):
    return {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(sorted(adapters.items()), start=1)}


GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=0)


def test_greedy_matches_peft(lora_llm, adapters, tiny_llama_dir):
    tok = lora_llm.get_tokenizer()
    for name, lr in _requests(adapters).items():
        oracle = peft_model(tiny_llama_dir, lr.lora_path)
        outs = lora_llm.generate(PROMPTS, GREEDY, lora_request=lr, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs):
            ref = greedy(oracle, tok.encode(prompt), N)
            got = out.outputs[0]
            k = matching_prefix(got.token_ids, ref)
            assert k >= N // 2, (name, prompt)
            lps = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids[:k])]
            assert max(abs(a - b) for a, b in zip(lps, ref[1][:k])) < 1e-3, name
    # and the adapters change the output: the base model's differs
    base = lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    adapted = lora_llm.generate(PROMPTS, GREEDY, lora_request=_requests(adapters)["all8"], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in base] != [o.outputs[0].token_ids for o in adapted]


def test_mixed_batch_equals_alone(lora_llm, adapters):
    reqs = [None, *_requests(adapters).values()]
    alone = {i: lora_llm.generate(PROMPTS, GREEDY, lora_request=lr, use_tqdm=False) for i, lr in enumerate(reqs)}
    prompts = [p for p in PROMPTS for _ in reqs]
    mixed = lora_llm.generate(
        prompts, GREEDY, lora_request=[reqs[i % len(reqs)] for i in range(len(prompts))], use_tqdm=False
    )
    for i, out in enumerate(mixed):
        assert out.outputs[0].token_ids == alone[i % len(reqs)][i // len(reqs)].outputs[0].token_ids


def test_more_adapters_than_slots_and_cpu_cache(tiny_llama_dir, adapters):
    """max_loras 2 (a step holds at most 2 adapters) and max_cpu_loras 2 (the others are read again)."""
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        kv_cache_memory=0.02,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=2,
        max_lora_rank=16,
    )
    reqs = list(_requests(adapters).values())
    alone = [llm.generate(PROMPTS[:2], GREEDY, lora_request=lr, use_tqdm=False) for lr in reqs]
    prompts = PROMPTS[:2] * len(reqs)
    mixed = llm.generate(prompts, GREEDY, lora_request=[lr for lr in reqs for _ in range(2)], use_tqdm=False)
    for i, out in enumerate(mixed):
        assert out.outputs[0].token_ids == alone[i // 2][i % 2].outputs[0].token_ids
    assert len(llm.engine.lora._loaded) <= 2


def test_prefix_cache_keyed_by_adapter(lora_llm, adapters):
    lr = _requests(adapters)["all8"]
    prompt = "Paged attention keeps the KV cache in fixed-size blocks. " * 3
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    base = lora_llm.generate([prompt], sp, use_tqdm=False)[0]
    first = lora_llm.generate([prompt], sp, lora_request=lr, use_tqdm=False)[0]
    again = lora_llm.generate([prompt], sp, lora_request=lr, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0  # the base model's K/V of the same prompt is not the adapter's
    assert again.num_cached_tokens > 0  # the adapter's own is
    assert first.outputs[0].token_ids == again.outputs[0].token_ids != base.outputs[0].token_ids


def test_chunked_prefill_preemption_and_n(tiny_llama_dir, adapters, lora_llm):
    """A tiny KV pool (preemptions) and 16-token chunks give the same greedy tokens as a roomy engine."""
    reqs = list(_requests(adapters).values())
    tight = LLM(
        tiny_llama_dir,
        dtype="float32",
        num_gpu_blocks_override=12,
        block_size=4,
        max_num_batched_tokens=16,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
    )
    prompts = [p for p in PROMPTS for _ in range(2)]
    loras = [reqs[i % len(reqs)] for i in range(len(prompts))]
    want = lora_llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    got = tight.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert tight.engine.core.scheduler.num_preemptions > 0
    two = lora_llm.generate(
        PROMPTS[:1],
        SamplingParams(n=2, max_tokens=N, temperature=0, ignore_eos=True),
        lora_request=reqs[0],
        use_tqdm=False,
    )[0]
    assert [c.token_ids for c in two.outputs] == [want[0].outputs[0].token_ids] * 2


def test_structured_output_and_speculation(tiny_llama_dir, adapters, lora_llm):
    lr = _requests(adapters)["qvd16"]
    spec = LLM(
        tiny_llama_dir,
        dtype="float32",
        kv_cache_memory=0.02,
        enable_lora=True,
        max_lora_rank=16,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
    )
    prompts = ["the quick brown fox the quick brown fox the quick", *PROMPTS]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = lora_llm.generate(prompts, sp, lora_request=lr, use_tqdm=False)
    got = spec.generate(prompts, sp, lora_request=lr, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert spec.engine.core.drafter.stats.num_draft_tokens > 0
    from tokenmill.sampling_params import GuidedDecodingParams

    choice = SamplingParams(max_tokens=8, temperature=0, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    out = lora_llm.generate(["Answer:"], choice, lora_request=lr, use_tqdm=False)[0]
    assert out.outputs[0].text in ("yes", "no")


def test_bf16_mixed_batch_is_batch_invariant(tiny_llama_dir, adapters):
    """bf16: a request's tokens and logprobs are the same bits alone and in a mixed batch (the
    LoRA kernel computes each row alike), through the fused decode step when it runs."""
    llm = LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_memory=0.02, enable_lora=True, max_loras=4, max_lora_rank=16)
    fused_lora_steps = []
    fd = llm.engine.core.runner.fast_decode
    if fd is not None:  # count the fused steps that carried adapter rows
        call = fd.__call__

        def counting(*args, row_slots=None, **kw):
            fused_lora_steps.append(row_slots is not None)
            return call(*args, row_slots=row_slots, **kw)

        llm.engine.core.runner.fast_decode = type(
            "Counted", (), {"accepts": staticmethod(fd.accepts), "__call__": staticmethod(counting)}
        )()
    reqs = [None, *_requests(adapters).values()]
    alone = [llm.generate(PROMPTS[:1], GREEDY, lora_request=lr, use_tqdm=False)[0].outputs[0] for lr in reqs]
    mixed = llm.generate(PROMPTS[:1] * len(reqs), GREEDY, lora_request=reqs, use_tqdm=False)
    from tokenmill.kernels import cpu_kernels

    if cpu_kernels.load() is not None and hasattr(cpu_kernels.load(), "FusedDecoder"):
        assert any(fused_lora_steps)  # adapters ran inside the fused decode step
    for a, m in zip(alone, mixed):
        assert m.outputs[0].token_ids == a.token_ids
        assert [lp[t].logprob for lp, t in zip(m.outputs[0].logprobs, a.token_ids)] == [
            lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)
        ]


def test_bad_adapters(tiny_llama_dir, tmp_path_factory, lora_llm, adapters):
    root = tmp_path_factory.mktemp("bad-lora")
    other = build_tiny_model(root / "wide", "llama", hidden_size=96, intermediate_size=192)
    bad = {
        "missing": str(root / "nowhere"),
        "shapes": make_adapter(str(other), root / "shapes", rank=8),
        "rank": make_adapter(tiny_llama_dir, root / "rank", rank=32),
        "save": make_adapter(tiny_llama_dir, root / "save", rank=8, modules_to_save=["lm_head"]),
        "head": make_adapter(tiny_llama_dir, root / "head", rank=8, targets=["q_proj", "lm_head"]),
        "embed": make_adapter(tiny_llama_dir, root / "embed", rank=8, targets=["embed_tokens"]),
    }
    messages = {
        "missing": "does not exist",
        "shapes": "another base model",
        "rank": "--max-lora-rank",
        "save": "modules_to_save",
        "head": "LM-head",
        "embed": "embedding",
    }
    for i, (name, path) in enumerate(bad.items(), start=10):
        with pytest.raises(LoRAError, match=messages[name]):
            lora_llm.generate(["Hi"], GREEDY, lora_request=LoRARequest(name, i, path), use_tqdm=False)
    with pytest.raises(LoRAError, match="unknown LoRA adapter"):
        lora_llm.engine.make_request("Hi", GREEDY, lora_request=LoRARequest("nobody", 99))
    assert not lora_llm.engine.has_unfinished_requests()
    plain = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02)
    with pytest.raises(LoRAError, match="enable-lora"):
        plain.generate(["Hi"], GREEDY, lora_request=LoRARequest("all8", 1, adapters["all8"]), use_tqdm=False)


@pytest.fixture(scope="module")
def qwen2_adapter(tiny_qwen2_dir, tmp_path_factory):
    return make_adapter(tiny_qwen2_dir, tmp_path_factory.mktemp("lora-qwen2") / "a", rank=8, seed=5)


def test_qwen2_tied_and_biased(tiny_qwen2_dir, qwen2_adapter):
    """Qwen2: q/k/v biases and tied embeddings under an adapter."""
    llm = LLM(tiny_qwen2_dir, dtype="float32", kv_cache_memory=0.02, enable_lora=True)
    oracle = peft_model(tiny_qwen2_dir, qwen2_adapter)
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("q", 1, qwen2_adapter), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref = greedy(oracle, tok.encode(prompt), N)
        assert matching_prefix(out.outputs[0].token_ids, ref) >= N // 2


def test_smollm2_adapter(smollm2_dir, tmp_path_factory):
    """The real model: a rank-16 adapter on every linear, greedy against transformers + peft."""
    path = make_adapter(smollm2_dir, tmp_path_factory.mktemp("lora-smollm2") / "a", rank=16, seed=6, std=0.02)
    llm = LLM(smollm2_dir, dtype="float32", kv_cache_memory=0.05, max_model_len=256, enable_lora=True)
    oracle = peft_model(smollm2_dir, path)
    tok = llm.get_tokenizer()
    prompts = PROMPTS[:2]
    outs = llm.generate(
        prompts,
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        lora_request=LoRARequest("s", 1, path),
        use_tqdm=False,
    )
    base = load_hf(smollm2_dir)
    changed = False
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        ref = greedy(oracle, ids, 8)
        assert matching_prefix(out.outputs[0].token_ids, ref) >= 4
        changed |= ref[0] != greedy(base, ids, 8)[0]
    assert changed  # the adapter matters
    del base
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
