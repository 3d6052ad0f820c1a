"""A fixed sampler scenario using every feature at once (penalties, logit_bias, min_tokens and
bad-word bans, watermark, grammar masks, top-k / top-p / min-p, seeds, logprobs, prompt
logprobs), run on any device. sampler_golden.json holds its CPU results as the CPU-only sampler
(commit 1036121) gave them, with the sampled rows' tokens (and what follows from them) as the
inverse-CDF draw gives them (rewritten when it replaced the exponential race);
test_sampler_device.py checks CPU still gives them and test_sampler_cuda.py compares CUDA with CPU. `python tests/sampler_scenario.py` rewrites the file
from the current sampler: only for a change of results that is meant."""

from __future__ import annotations

import ctypes
import json
import math
from pathlib import Path

import numpy as np
import torch

from tokenmill import SamplingParams
from tokenmill.request import Request
from tokenmill.sample.sampler import Sampler, SamplingBatch, score_tokens

V = 100  # not a multiple of 32: the grammar bitmask's last word is partial
STEPS = 4
EOS = frozenset({0})
GOLDEN = Path(__file__).with_name("sampler_golden.json")


class FakeMatcher:
    """Stands in for an llguidance matcher: always allows the same tokens (tokenizer-free)."""

    def __init__(self, allowed: list[int]):
        self.allowed = sorted(allowed)
        bits = np.zeros((V + 31) // 32 * 32, dtype=np.uint8)
        bits[self.allowed] = 1
        self._words = np.packbits(bits, bitorder="little").view(np.int32).copy()

    def unsafe_compute_mask_ptr(self, ptr: int, nbytes: int) -> None:
        assert nbytes == self._words.nbytes
        ctypes.memmove(ptr, self._words.ctypes.data, nbytes)


GRAMMARS = {7: [2, 17, 33, 64, 65, 99], 8: [0, 7], 9: list(range(40, 51))}


def make_requests(rows: list[int] | None = None) -> list[Request]:
    """The scenario's requests (fresh: seeds restart), or only the given rows of it."""
    S = SamplingParams
    specs = [
        ([5, 6, 7], S(temperature=0.0, logprobs=3), {}),
        (
            list(range(1, 11)),
            S(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.3, logprobs=0),
            {"out": [5, 5, 30, 5]},
        ),
        ([3, 3, 4], S(temperature=0.8, seed=11, top_k=5, logprobs=2), {}),
        ([8, 9], S(temperature=2.0, seed=12, top_p=0.5, min_p=0.02, logit_bias={3: 5.0, 4: -100.0, 50: 2.5}), {}),
        (
            [11, 12, 13],
            S(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.4),
            {"out": [12, 60, 60]},
        ),
        ([14], S(temperature=0.0, min_tokens=3, stop_token_ids=[7, 9]), {"bad": [[13], [20, 21]], "out": [20]}),
        ([15, 16], S(temperature=1.5, seed=13, min_p=0.3, watermark=True, logprobs=1), {}),
        ([17], S(temperature=0.0, logprobs=2), {"grammar": 7}),
        ([18], S(temperature=1.0, seed=14, min_tokens=5, stop_token_ids=[7], logit_bias={0: 1.0}), {"grammar": 8}),
        ([19], S(temperature=0.7, seed=15, top_k=3, logit_bias={1: 100.0}), {"grammar": 9}),
    ]
    reqs = []
    for i, (prompt, params, extra) in enumerate(specs):
        if rows is not None and i not in rows:
            continue
        r = Request(f"r{i}", prompt, params, eos_token_ids=EOS, bad_words_token_ids=extra.get("bad", []))
        for t in extra.get("out", []):
            r.append_output_token(t)
        if "grammar" in extra:
            r.matcher = FakeMatcher(GRAMMARS[extra["grammar"]])
        reqs.append(r)
    return reqs


def step_logits(step: int) -> torch.Tensor:
    return torch.randn(10, V, generator=torch.Generator().manual_seed(100 + step)) * 2.0


def _batch(reqs: list[Request], device: str | None) -> SamplingBatch:
    if device is None:
        return SamplingBatch.from_requests(reqs, V)
    return SamplingBatch.from_requests(reqs, V, device=device)


def _lps(out) -> list:
    return [None if lp is None else [lp.token_logprob, lp.rank, [list(t) for t in lp.top]] for lp in out.logprobs]


def logit_stats(logits: torch.Tensor) -> list[list[float]]:
    """Per row: masked (-inf) count, sum and position-weighted sum of the rest (sensitive to
    every processing step without storing [B, V] values)."""
    x = logits.double().cpu()
    masked = torch.isneginf(x)
    x = x.masked_fill(masked, 0.0)
    w = torch.arange(1, x.shape[1] + 1, dtype=torch.float64)
    return [[float(m), s, ws] for m, s, ws in zip(masked.sum(1).tolist(), x.sum(1).tolist(), (x * w).sum(1).tolist())]


def run(device: str | None = None, rows: list[int] | None = None) -> dict:
    """Results of the scenario (all rows, or a sub-batch) on `device` (None: the default, CPU)."""
    dev = device or "cpu"
    reqs = make_requests(rows)
    idx = torch.tensor(rows if rows is not None else range(10))
    sampler = Sampler(seed=3)
    tokens, lps, stats = [], [], []
    for step in range(STEPS):
        logits = step_logits(step)[idx].to(dev)
        batch = _batch(reqs, device)
        stats.append(logit_stats(sampler.process_logits(logits, batch)))  # draws no noise
        out = sampler(logits, batch)
        tokens.append(out.token_ids)
        lps.append(_lps(out))
        for r, t in zip(reqs, out.token_ids):
            r.append_output_token(t)
    # The all-greedy path, with penalties on every row.
    greedy = [
        Request(
            f"g{i}",
            [1, 2, 3, 40 + i],
            SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=i),
            eos_token_ids=EOS,
        )
        for i in range(3)
    ]
    out = Sampler()(step_logits(9)[:3].to(dev), _batch(greedy, device))
    g = {"tokens": out.token_ids, "logprobs": _lps(out)}
    prompt_logits = step_logits(7)[:6].to(dev)
    scores = {
        str(n): [
            [s.token_logprob, s.rank, [list(t) for t in s.top]]
            for s in score_tokens(prompt_logits, [4, 0, 99, 50, 50, 7], n)
        ]
        for n in (0, 3)
    }
    return {"tokens": tokens, "logprobs": lps, "processed": stats, "greedy": g, "scores": scores}


def assert_same(got, want, tol: float = 1e-6, path: str = "") -> None:
    """Equal structures: ints exactly, floats within tol."""
    if isinstance(want, float):
        assert math.isclose(got, want, rel_tol=0, abs_tol=tol), f"{path}: {got} != {want}"
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: {got} != {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, tol, f"{path}[{i}]")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for k in want:
            assert_same(got[k], want[k], tol, f"{path}.{k}")
    else:
        assert got == want and type(got) is type(want), f"{path}: {got!r} != {want!r}"


def load_golden() -> dict:
    return json.loads(GOLDEN.read_text())


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(run(), indent=None) + "\n")
