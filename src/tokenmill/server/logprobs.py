"""Logprobs as the APIs write them: JSON-safe numbers, vLLM's prompt_logprobs, OpenAI chat's
logprobs.content entries."""

from __future__ import annotations

import math

from tokenmill.outputs import Logprob, RequestOutput


def prompt_logprobs_json(out: RequestOutput) -> list[dict | None] | None:
    """vLLM's shape: per prompt token {token id: {logprob, rank, decoded_token}}, null for the first."""
    if out.prompt_logprobs is None:
        return None
    return [
        None
        if step is None
        else {
            str(t): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in step.items()
        }
        for step in out.prompt_logprobs
    ]


def clamp_logprob(x: float) -> float:
    """JSON has no -inf; vLLM reports -9999.0 instead."""
    return -9999.0 if (math.isinf(x) or math.isnan(x)) else max(x, -9999.0)


def _entry(e: Logprob) -> dict:
    token = e.decoded_token or ""
    return {"token": token, "logprob": clamp_logprob(e.logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int) -> list[dict]:
    """OpenAI's logprobs.content entries (ChatLogProbsContent's shape, as plain dicts)."""
    content = []
    for tid, step in zip(token_ids, logprobs):
        tops = sorted((e for e in step.values() if e.rank is not None and e.rank <= top_n), key=lambda e: e.rank)
        content.append({**_entry(step[tid]), "top_logprobs": [_entry(e) for e in tops[:top_n]]})
    return content
