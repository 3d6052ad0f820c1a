"""Hugging Face transformers as the oracle: greedy decoding with full-vocab logprobs."""

from __future__ import annotations

import functools

import torch

from tokenmill import LLM, SamplingParams


@functools.lru_cache(maxsize=4)
def load_hf(model_dir: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **hf_attention(model_dir)).eval()


def hf_attention(model_dir: str) -> dict:
    """Gemma 2 needs transformers' eager attention (SDPA has no soft-capping): some transformers
    versions pick it themselves (5.24), others SDPA (5.17, which then drops the cap)."""
    import json
    import os

    with open(os.path.join(model_dir, "config.json")) as f:
        return {"attn_implementation": "eager"} if json.load(f).get("model_type") == "gemma2" else {}


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens (EOS ignored), the log-probability of each under the model, and each
    step's margin over the runner-up (top-1 minus top-2 logprob)."""
    return greedy(load_hf(model_dir), prompt_ids, max_new_tokens)


@torch.inference_mode()
def greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float], list[float]]:
    """hf_greedy on a model already loaded (e.g. a peft model with an adapter)."""
    ids = torch.tensor([prompt_ids])
    out = model(ids, use_cache=True)
    past = out.past_key_values
    tokens, logprobs, margins = [], [], []
    logits = out.logits[0, -1].float()
    for _ in range(max_new_tokens):
        lp = torch.log_softmax(logits, -1)
        top2 = lp.topk(2)
        tok = int(top2.indices[0])
        tokens.append(tok)
        logprobs.append(float(top2.values[0]))
        margins.append(float(top2.values[0] - top2.values[1]))
        out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
    return tokens, logprobs, margins


NEAR_TIE = 1e-3  # logprob gap under which float rounding may pick either token


def matching_prefix(got: list[int], expected: tuple[list[int], list[float], list[float]]) -> int:
    """How many leading tokens of `got` to compare with the oracle: all of them, unless they
    part ways at a near-tie (top-2 logprobs within NEAR_TIE), where either pick is correct
    and what follows can no longer be compared. Any other divergence fails."""
    toks, _, margins = expected
    assert len(got) == len(toks), (got, toks)
    for i, (a, b) in enumerate(zip(got, toks)):
        if a != b:
            assert margins[i] < NEAR_TIE, f"token {i}: got {a}, oracle {b} (margin {margins[i]:.2e}); {got} != {toks}"
            return i
    return len(toks)


def check_against_hf(llm: LLM, hf_dir: str, prompts: list[str], max_tokens: int = 16) -> None:
    """The engine's greedy tokens and logprobs are transformers' on hf_dir, and the tight KV pool preempted."""
    ids = [llm.get_tokenizer().encode(p) for p in prompts]
    expected = [hf_greedy(hf_dir, p, max_tokens) for p in ids]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    core = llm.engine.core
    before = core.scheduler.num_preemptions
    for out, exp in zip(llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False), expected):
        n = matching_prefix(out.outputs[0].token_ids, exp)
        got = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs[: n + 1]]
        assert max(abs(a - b) for a, b in zip(got, exp[1])) < 1e-3
    assert core.scheduler.num_preemptions > before
    assert core.kv.num_free_blocks == core.kv.num_usable_blocks
