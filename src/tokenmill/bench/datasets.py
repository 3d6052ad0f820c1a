"""Request sets for `tokenmill bench serve`: random, ShareGPT and shared-prefix prompts."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from tokenmill.model.loader import resolve_model_path


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens, as counted by the benchmark's tokenizer
    output_len: int  # max_tokens sent (with ignore_eos, the exact output length)


def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(path))


def _special_ids(tok) -> set[int]:
    return set(getattr(tok, "all_special_ids", []) or [])


def _random_text(tok, rng: random.Random, n: int, allowed: list[int]) -> str:
    return tok.decode([rng.choice(allowed) for _ in range(n)])


def _allowed_ids(tok) -> list[int]:
    special = _special_ids(tok)
    return [i for i in range(len(tok)) if i not in special]


def _lens(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi) if hi > lo else max(1, mean)


def random_requests(
    tok, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[BenchRequest]:
    """Prompts of random token ids decoded to text; lengths uniform in [len*(1-r), len*(1+r)]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    allowed = _allowed_ids(tok)
    reqs = []
    for _ in range(num_prompts):
        n_in, n_out = _lens(rng, input_len, range_ratio), _lens(rng, output_len, range_ratio)
        text = _random_text(tok, rng, n_in, allowed)
        reqs.append(BenchRequest(text, len(tok.encode(text, add_special_tokens=False)), n_out))
    return reqs


def prefix_requests(
    tok, num_prompts: int, prefix_len: int, input_len: int, output_len: int, seed: int = 0
) -> list[BenchRequest]:
    """`num_prompts` prompts sharing one common prefix of `prefix_len` random tokens, each followed
    by its own `input_len` random tokens (a prefix-caching workload)."""
    rng = random.Random(seed)
    allowed = _allowed_ids(tok)
    prefix = _random_text(tok, rng, prefix_len, allowed)
    reqs = []
    for _ in range(num_prompts):
        text = prefix + _random_text(tok, rng, input_len, allowed)
        reqs.append(BenchRequest(text, len(tok.encode(text, add_special_tokens=False)), output_len))
    return reqs


def sharegpt_requests(
    tok,
    path: str,
    num_prompts: int,
    output_len: int | None = None,
    seed: int = 0,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
) -> list[BenchRequest]:
    """ShareGPT JSON: a list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}.
    The first human turn is the prompt; the token count of the gpt answer after it is the output length
    (unless `output_len` is given). Conversations are shuffled with `seed`; too short / long ones skipped."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    rng = random.Random(seed)
    rng.shuffle(data)
    reqs: list[BenchRequest] = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") or []
        prompt = answer = None
        for i, t in enumerate(turns):
            if t.get("from") in ("human", "user") and prompt is None:
                prompt = t.get("value", "")
                nxt = turns[i + 1] if i + 1 < len(turns) else None
                if nxt is not None and nxt.get("from") in ("gpt", "assistant", "chatgpt"):
                    answer = nxt.get("value", "")
                break
        if not prompt or answer is None:
            continue
        n_in = len(tok.encode(prompt, add_special_tokens=False))
        n_out = output_len or len(tok.encode(answer, add_special_tokens=False))
        if n_in < 4 or n_out < 4 or n_in > max_prompt_len or n_in + n_out > max_total_len:
            continue
        reqs.append(BenchRequest(prompt, n_in, n_out))
        if len(reqs) >= num_prompts:
            break
    if not reqs:
        raise ValueError(f"no usable conversation in {path!r}")
    return reqs
