"""Batched sampling: per-request parameters become tensors, one pass over the batch.

Order (as vLLM): penalties, min_tokens, bad words, logit_bias and the watermark on the raw
logits, then greedy rows take an exact argmax; the rest are scaled by temperature, truncated by top-k / top-p / min-p and sampled
with the exponential-race trick (argmax of p / Exp(1) noise), which lets a seeded request
draw its noise from its own generator: the same seed gives the same tokens whatever batch
it is in. Logprobs are those of the model's raw distribution (before any processing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.request import Request
from tokenmill.model.layers import cpu_kernels
from tokenmill.structured_output import apply_grammar_masks
from tokenmill.watermark import WatermarkConfig, apply_watermark


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B]; 0 means greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] long, vocab size where disabled
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: list[torch.Generator | None]
    # Penalties (None when no request in the batch uses them).
    repetition_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    output_counts: torch.Tensor | None  # [B, V] occurrences in the output so far
    seen_mask: torch.Tensor | None  # [B, V] in prompt or output (repetition penalty)
    banned: list[tuple[int, list[int]]]  # (row, token ids) masked out: min_tokens, bad words
    num_logprobs: list[int | None]
    logit_bias: list[tuple[int, list[int], list[float]]]  # (row, token ids, biases)
    watermark_rows: list[int]
    watermark_prev: list[int]  # the token before each watermarked row's next one
    matchers: list | None = None  # structured output: a grammar matcher per row (None: free)

    @classmethod
    def from_requests(cls, reqs: list[Request], vocab_size: int) -> "SamplingBatch":
        ps = [r.sampling_params for r in reqs]
        B = len(reqs)
        temps = torch.tensor([0.0 if p.greedy else p.temperature for p in ps], dtype=torch.float32)
        all_greedy = all(p.greedy for p in ps)
        sampling = [p for p in ps if not p.greedy]
        top_k = top_p = min_p = None
        if any(p.top_k > 0 for p in sampling):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in ps], dtype=torch.long)
        if any(p.top_p < 1.0 for p in sampling):
            top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32)
        if any(p.min_p > 0.0 for p in sampling):
            min_p = torch.tensor([p.min_p for p in ps], dtype=torch.float32)

        rep = pres = freq = counts = seen = None
        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in ps):
            rep = torch.tensor([p.repetition_penalty for p in ps], dtype=torch.float32)
            pres = torch.tensor([p.presence_penalty for p in ps], dtype=torch.float32)
            freq = torch.tensor([p.frequency_penalty for p in ps], dtype=torch.float32)
            counts = torch.zeros(B, vocab_size, dtype=torch.float32)
            seen = torch.zeros(B, vocab_size, dtype=torch.bool)
            for i, r in enumerate(reqs):
                out = torch.tensor(r.output_token_ids, dtype=torch.long)
                counts[i].index_add_(0, out, torch.ones(len(out)))
                seen[i, torch.tensor(r.all_token_ids, dtype=torch.long)] = True

        banned, bias, wm_rows, wm_prev = [], [], [], []
        for i, r in enumerate(reqs):
            p = r.sampling_params
            ids = []
            if r.num_output_tokens < p.min_tokens:
                ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
            ids += _bad_word_bans(r)
            if ids:
                banned.append((i, ids))
            if p.logit_bias:
                bias.append((i, list(p.logit_bias), list(p.logit_bias.values())))
            if p.watermark:
                wm_rows.append(i)
                wm_prev.append(r.all_token_ids[-1])
        return cls(
            temperature=temps, all_greedy=all_greedy, top_k=top_k, top_p=top_p, min_p=min_p,
            generators=[r.generator for r in reqs], repetition_penalty=rep, presence_penalty=pres,
            frequency_penalty=freq, output_counts=counts, seen_mask=seen, banned=banned,
            num_logprobs=[p.logprobs for p in ps], logit_bias=bias, watermark_rows=wm_rows,
            watermark_prev=wm_prev,
            matchers=[r.matcher for r in reqs] if any(r.matcher is not None for r in reqs) else None,
        )


def _bad_word_bans(r: Request) -> list[int]:
    """Tokens that would complete a bad word: a one-token word always, a longer one when the
    output so far ends with all its tokens but the last (vLLM's rule)."""
    out = r.output_token_ids
    bans = []
    for seq in r.bad_words_token_ids:
        k = len(seq) - 1
        if k == 0 or (len(out) >= k and out[-k:] == seq[:-1]):
            bans.append(seq[-1])
    return bans


@dataclass
class SampleLogprobs:
    token_logprob: float
    rank: int  # 1 = most likely
    top: list[tuple[int, float]]  # top-N (token id, logprob), most likely first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[SampleLogprobs | None]


def score_tokens(logits: torch.Tensor, targets: list[int], top_n: int) -> list[SampleLogprobs]:
    """Logprob and rank of targets[i] under row i of logits, plus each row's top N."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    tgt = torch.tensor(targets, dtype=torch.long).unsqueeze(1)
    chosen = lp.gather(1, tgt)
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in targets]
    if top_n > 0:
        vals, ids = lp.topk(top_n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return [SampleLogprobs(c, r, t) for c, r, t in zip(chosen.squeeze(1).tolist(), ranks, tops)]


class Sampler:
    def __init__(self, seed: int = 0, watermark: WatermarkConfig | None = None):
        self.generator = torch.Generator().manual_seed(seed)
        self.watermark = watermark or WatermarkConfig()

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [B, V] float32 from the model."""
        want_logprobs = any(n is not None for n in batch.num_logprobs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = self._process_logits(logits, batch)
        if batch.all_greedy:
            tokens = _argmax(logits)
        else:
            tokens = self._sample(logits, batch)
        token_list = tokens.tolist()
        lps: list[SampleLogprobs | None] = [None] * len(token_list)
        if raw_logprobs is not None:
            for i, n in enumerate(batch.num_logprobs):
                if n is None:
                    continue
                row = raw_logprobs[i]
                tok_lp = row[token_list[i]]
                rank = int((row > tok_lp).sum().item()) + 1
                top = []
                if n > 0:
                    vals, ids = row.topk(n)
                    top = list(zip(ids.tolist(), vals.tolist()))
                lps[i] = SampleLogprobs(float(tok_lp), rank, top)
        return SamplerOutput(token_list, lps)

    def _process_logits(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        if b.repetition_penalty is None and not b.banned and not b.logit_bias and not b.watermark_rows \
                and b.matchers is None:
            return logits
        logits = logits.clone()
        if b.repetition_penalty is not None:
            rp = b.repetition_penalty.unsqueeze(1)
            penalized = torch.where(logits > 0, logits / rp, logits * rp)
            logits = torch.where(b.seen_mask, penalized, logits)
            logits -= b.frequency_penalty.unsqueeze(1) * b.output_counts
            logits -= b.presence_penalty.unsqueeze(1) * (b.output_counts > 0).float()
        for row, ids, values in b.logit_bias:
            logits[row, ids] += torch.tensor(values, dtype=logits.dtype)
        if b.watermark_rows:
            apply_watermark(logits, b.watermark_rows, b.watermark_prev, self.watermark)
        # A grammar outranks min_tokens and bad words: a row whose bans leave the grammar no token
        # (e.g. its output is complete but min_tokens bans EOS) takes the grammar's tokens alone.
        unbanned = {row: logits[row].clone() for row, _ in b.banned if b.matchers and b.matchers[row] is not None}
        for row, ids in b.banned:
            logits[row, ids] = float("-inf")
        if b.matchers is not None:  # last: nothing may bring back a token the grammar forbids
            apply_grammar_masks(logits, b.matchers)
            for row, before in unbanned.items():
                if torch.isneginf(logits[row]).all():
                    apply_grammar_masks(before.unsqueeze(0), [b.matchers[row]])
                    logits[row] = before
        return logits

    def _sample(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        greedy_rows = b.temperature == 0
        greedy_tokens = _argmax(logits)
        temp = torch.where(greedy_rows, torch.ones_like(b.temperature), b.temperature)
        logits = logits / temp.unsqueeze(1)
        if b.top_k is not None or b.top_p is not None:
            logits = _top_k_top_p(logits, b.top_k, b.top_p)
        probs = torch.softmax(logits, dim=-1)
        if b.min_p is not None:
            thresh = b.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < thresh, 0.0)
        noise = torch.empty_like(probs)
        for i, g in enumerate(b.generators):
            noise[i].exponential_(generator=g if g is not None else self.generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy_rows, greedy_tokens, sampled)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest logit's index: the C++ kernel on CPU (one pass; torch's max over
    32 x 49152 takes ~1.3 ms on 2 cores), else torch (max is faster than argmax, same tie rule)."""
    ops = cpu_kernels.ops_for(logits)
    if ops is not None and logits.dtype == torch.float32 and logits.dim() == 2:
        return ops.argmax_rows(logits)
    return logits.max(dim=-1).indices


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    if top_k is not None:
        # Keep the k largest; ties at the boundary kept, as in a threshold on the k-th value.
        kth = sorted_logits.gather(1, (top_k.clamp(1, V) - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        # Drop tokens once the mass before them already reaches top_p (the first always stays,
        # also when top_p is below float32's range and so 0 here: 1e-50 would drop every token).
        drop = (cum - probs) >= top_p.unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, idx, sorted_logits)
