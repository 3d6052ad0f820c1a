"""Exact verification of draft tokens (speculative sampling, Leviathan et al. / Chen et al.).

Per request i with k_i >= 0 drafts x_1..x_k the target scored k_i + 1 positions: row j holds the
distribution of the token after drafts x_1..x_j (row 0: after the context alone). Rows of all
requests are stacked in request order, k_i + 1 per request.
- Greedy requests accept x_{j+1} while it equals row j's argmax; the extra token is the argmax of
  the first mismatching row (or of row k_i: the bonus token). Bit-exact with decoding one by one
  as long as the argmax comes from the same processed logits and the same kernel as the Sampler's.
- Sampling requests accept x_{j+1} with probability min(1, p_j(x) / q_j(x)) (q one-hot for n-gram
  and suffix drafts, so p_j(x)); at the first rejection the extra token is drawn from
  norm(max(p_j - q_j, 0)), and after k_i acceptances from p_{k_i}. Each emitted token is then
  distributed exactly as the target's p, whatever q is.
Random numbers: a seeded request draws its k_i uniforms, then what its one extra token needs, from
its own generator, so the same seed gives the same tokens whatever the batch; unseeded requests
share `generator`, one draw for all of them. The extra token is drawn from the (unnormalised) r by
inverse CDF, the Sampler's own draw (sample_method="inverse_cdf", the default: one uniform, and a
request without drafts gets the very token the Sampler would give), or by vLLM's exponential race
argmax(r / E) ("exponential": the same distribution, but V Exp(1) draws cost ~1 ms per row at 49k on CPU).
Noise is drawn for one row per request, never for all k_i + 1. One device-to-host copy per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.sample.sampler import Sampler, SamplingBatch, argmax_tokens, draw_inverse_cdf, per_row, sampling_probs


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per request: the accepted drafts, then one sampled token
    num_accepted: list[int]  # per request: accepted drafts (len(token_ids[i]) - 1)

    def accepted_per_position(self, num_draft_tokens: Sequence[int]) -> list[tuple[int, int]]:
        """(drafted, accepted) counts per draft position 0, 1, ..., for vLLM's per-position metric."""
        K = max(num_draft_tokens, default=0)
        drafted = [sum(k > j for k in num_draft_tokens) for j in range(K)]
        accepted = [sum(n > j for n in self.num_accepted) for j in range(K)]
        return list(zip(drafted, accepted))


def rejection_sample(
    draft_token_ids: Sequence[Sequence[int]],
    target_probs: torch.Tensor | None,
    target_argmax: torch.Tensor | None,
    greedy: Sequence[bool],
    draft_probs: torch.Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    generator: torch.Generator | None = None,
    sample_method: str = "inverse_cdf",
    probs_normalized: bool = False,
) -> VerifyOutput:
    """draft_token_ids: per request its k_i drafts (k_i may be 0).
    target_probs: [sum(k_i + 1), V] float32, the target's processed distribution per row (after
        penalties, bans, grammar, temperature, top-k/top-p/min-p), normalised or not (see
        probs_normalized). May be None when every request is greedy; greedy requests' rows are
        never read.
    target_argmax: [sum(k_i + 1)] int, each row's argmax of the processed logits; required when any
        request is greedy (sampling requests' entries are never read).
    greedy: per request, temperature == 0.
    draft_probs: [sum(k_i), V], the draft model's processed probabilities of each draft position
        (the distribution x was sampled from), or None for one-hot drafts (n-gram, suffix, or a
        draft model that drafts greedily).
    generators: per request, its seeded generator on the tensors' device, or None to use
        `generator` (the Sampler's own for that device; torch's global one if None).
    sample_method: how the one extra token per request is drawn. "inverse_cdf" (default): the
        Sampler's own draw, one uniform and a two-level cumulative sum per request (~1 ms for 32
        requests at V = 49k on 2 CPU cores; a seeded request without drafts gets the Sampler's very
        token); "exponential": the exponential race, the same distribution (V Exp(1) draws per
        request: ~30 ms for the same 32).
    probs_normalized: the caller guarantees every row of target_probs (and draft_probs) sums to 1,
        which skips a pass over them. By default they are normalised here, because acceptance
        compares probabilities: the Sampler's min-p zeroes tokens after the softmax without
        renormalising, and accepting with the unnormalised p(x) would under-accept (biased output).
    """
    if sample_method not in ("exponential", "inverse_cdf"):
        raise ValueError(f"sample_method must be 'exponential' or 'inverse_cdf', not {sample_method!r}")
    B = len(draft_token_ids)
    if len(greedy) != B or (generators is not None and len(generators) != B):
        raise ValueError("draft_token_ids, greedy and generators must have one entry per request")
    ks = [len(d) for d in draft_token_ids]
    n_rows, n_drafts = sum(ks) + B, sum(ks)
    ref = target_probs if target_probs is not None else target_argmax
    if ref is None:
        raise ValueError("need target_probs (sampling requests) and/or target_argmax (greedy requests)")
    dev = ref.device
    any_greedy, any_random = any(greedy), not all(greedy)
    if any_random and target_probs is None:
        raise ValueError("target_probs is required when a request samples (temperature > 0)")
    if any_greedy and target_argmax is None:
        raise ValueError("target_argmax is required when a request is greedy")
    for name, t, n in (
        ("target_probs", target_probs, n_rows),
        ("target_argmax", target_argmax, n_rows),
        ("draft_probs", draft_probs, n_drafts),
    ):
        if t is not None and t.shape[0] != n:
            raise ValueError(f"{name} has {t.shape[0]} rows, expected {n} for drafts of lengths {ks}")
    gens = list(generators) if generators is not None else [None] * B
    own = generator  # None: torch's default generator

    row_start, draft_start = [0] * B, [0] * B
    for i in range(1, B):
        row_start[i] = row_start[i - 1] + ks[i - 1] + 1
        draft_start[i] = draft_start[i - 1] + ks[i - 1]
    # Host-built indices, one copy: per draft its request, position, target row and token.
    idx = torch.tensor(
        [
            [i for i in range(B) for _ in range(ks[i])],
            [j for k in ks for j in range(k)],
            [row_start[i] + j for i in range(B) for j in range(ks[i])],
            [t for d in draft_token_ids for t in d],
        ],
        dtype=torch.long,
    ).to(dev)
    req_of, pos_of, rows, drafts = idx.unbind(0)
    meta = torch.tensor([row_start, draft_start, ks, [int(g) for g in greedy]], dtype=torch.long).to(dev)
    row_start_t, draft_start_t, ks_t, greedy_t = meta[0], meta[1], meta[2], meta[3].bool()

    # Acceptance of every draft, then each request's count of leading acceptances.
    n_acc = torch.zeros(B, dtype=torch.long, device=dev)
    z = zq = None  # row masses: acceptance compares normalised probabilities
    if any_random and n_drafts:
        assert target_probs is not None  # checked above
        z = None if probs_normalized else target_probs.sum(dim=1)
        zq = None if draft_probs is None or probs_normalized else draft_probs.sum(dim=1)
    if n_drafts:
        accept = torch.zeros(n_drafts, dtype=torch.bool, device=dev)
        if any_greedy:
            assert target_argmax is not None  # checked above
            accept = drafts == target_argmax[rows].long()
        if any_random:
            # Uniforms: a seeded request's from its generator; the unseeded ones' in one draw.
            u = torch.ones(n_drafts, dtype=torch.float32, device=dev)
            shared = [
                j
                for i in range(B)
                if not greedy[i] and gens[i] is None
                for j in range(draft_start[i], draft_start[i] + ks[i])
            ]
            if shared:
                u[torch.tensor(shared, dtype=torch.long).to(dev)] = torch.rand(len(shared), generator=own, device=dev)
            for i in range(B):
                if not greedy[i] and ks[i] and gens[i] is not None:
                    u[draft_start[i] : draft_start[i] + ks[i]] = torch.rand(ks[i], generator=gens[i], device=dev)
            # Accept with probability min(1, p(x) / q(x)), as u * q(x) < p(x): no division, q = 0 < p accepts.
            assert target_probs is not None  # checked above
            p_x = target_probs[rows, drafts].float()
            rhs = u if z is None else u * z[rows]
            if draft_probs is not None:
                q_x = draft_probs[torch.arange(n_drafts, device=dev), drafts].float()
                rhs = rhs * (q_x if zq is None else q_x / zq)
            random_accept = rhs < p_x
            accept = torch.where(greedy_t[req_of], accept, random_accept) if any_greedy else random_accept
        padded = torch.zeros(B, max(ks), dtype=torch.long, device=dev)
        padded[req_of, pos_of] = accept.long()
        n_acc = padded.cumprod(dim=1).sum(dim=1)

    final_rows = row_start_t + n_acc
    final = torch.zeros(B, dtype=torch.long, device=dev)
    if any_greedy:
        assert target_argmax is not None  # checked above
        final = target_argmax[final_rows].long()
    if any_random:
        assert target_probs is not None  # checked above
        rand_idx = [i for i in range(B) if not greedy[i]]
        ridx = torch.tensor(rand_idx, dtype=torch.long).to(dev)
        f_rows = final_rows[ridx]
        dist = target_probs[f_rows].float()  # a copy (advanced indexing): edited in place below
        if n_drafts:
            rejected = (n_acc < ks_t)[ridx]
            # The rejected draft's index (clamped: rows with nothing rejected are left as they are).
            d_idx = (draft_start_t + n_acc)[ridx].clamp(max=n_drafts - 1)
            if draft_probs is None:  # one-hot q: max(p - q, 0) is p without the rejected draft
                ar, x = torch.arange(len(rand_idx), device=dev), drafts[d_idx]
                dist[ar, x] = torch.where(rejected, torch.zeros((), device=dev), dist[ar, x])
            else:
                pn = dist if z is None else dist / z[f_rows].unsqueeze(1)
                q = draft_probs[d_idx].float()
                residual = (pn - (q if zq is None else q / zq[d_idx].unsqueeze(1))).clamp_(min=0.0)
                # p == q to the last bit leaves no mass (a rejection then had probability ~0): use p.
                residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, pn)
                dist = torch.where(rejected.unsqueeze(1), residual, dist)
        gen_rows = [gens[i] for i in rand_idx]
        if sample_method == "exponential":
            sampled = (dist / per_row(lambda t, g: t.exponential_(generator=g), dist, gen_rows, own)).argmax(dim=-1)
        else:
            sampled = draw_inverse_cdf(dist, gen_rows, own)
        final = final.index_copy(0, ridx, sampled) if any_greedy else sampled

    host = torch.cat([n_acc, final]).tolist()  # the one sync
    n_acc_h, final_h = host[:B], host[B:]
    tokens = [list(draft_token_ids[i][: n_acc_h[i]]) + [final_h[i]] for i in range(B)]
    return VerifyOutput(tokens, n_acc_h)


def target_distributions(
    sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(probs, argmax) for rejection_sample from the target's logits over the verification rows,
    computed as Sampler.__call__ computes them (the same functions, so the same bits): processed
    logits, their argmax with the same kernel, then sampling_probs (temperature, top-k/top-p, min-p).
    `batch` is a SamplingBatch with one row per verified position. probs is None when every row
    is greedy."""
    processed = sampler.process_logits(logits, batch)
    argmax = argmax_tokens(processed, sampler.ops)
    return (None if batch.all_greedy else sampling_probs(processed, batch, sampler.ops)), argmax
