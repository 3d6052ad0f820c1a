"""Hugging Face transformers as the oracle: greedy decoding with full-vocab logprobs."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def load_hf(model_dir: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens (EOS ignored) and the log-probability of each under the model."""
    model = load_hf(model_dir)
    ids = torch.tensor([prompt_ids])
    out = model(ids, use_cache=True)
    past = out.past_key_values
    tokens, logprobs = [], []
    logits = out.logits[0, -1].float()
    for _ in range(max_new_tokens):
        lp = torch.log_softmax(logits, -1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
    return tokens, logprobs
