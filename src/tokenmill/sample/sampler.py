"""Batched sampling: per-request parameters become tensors, one pass over the batch.

Order (as vLLM): penalties, min_tokens, bad words, logit_bias and the watermark on the raw
logits, then greedy rows take an exact argmax; the rest are scaled by temperature, truncated by
top-k / top-p / min-p and sampled by inverse CDF: one uniform per row, from the request's own
generator when it has a seed, so the same seed gives the same tokens whatever batch it is in (on
each device; CPU and CUDA draw different numbers). (vLLM's exponential race, argmax of p / Exp(1)
noise, draws V numbers a row: ~30 ms a step for 32 rows at V = 49k on 2 CPU cores.) Logprobs
are those of the model's raw distribution (before any processing).

Everything runs on the logits' device: SamplingBatch.from_requests(..., device=logits.device)
puts the batch there, and a step waits for the device once, to copy its results to the host.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

import torch

from tokenmill.config import WatermarkConfig
from tokenmill.kernels.cpu_kernels import KernelModule
from tokenmill.model.layers.bind import kernels_for
from tokenmill.request import Request
from tokenmill.sample.structured_output import apply_grammar_masks
from tokenmill.sample.watermark import apply_watermark

if TYPE_CHECKING:
    from tokenmill.sampling_params import SamplingParams


class SamplingRow(Protocol):
    """What SamplingBatch.from_requests reads of a row: a Request, or a request at one of its draft
    positions (sample/verify.py's DraftPosition)."""

    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def eos_token_ids(self) -> frozenset[int]: ...
    @property
    def bad_words_token_ids(self) -> list[list[int]]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def all_token_ids(self) -> list[int]: ...
    @property
    def matcher(self) -> Any: ...  # an llguidance LLMatcher, a verify.MatcherAt, or None
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    def generator_for(self, device: torch.device) -> torch.Generator | None: ...


@dataclass
class SamplingBatch:
    """Every tensor lives on the logits' device (from_requests' `device`)."""

    temperature: torch.Tensor | None  # [B]; 0 means greedy; None when all_greedy (nothing samples)
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] long, vocab size where disabled
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: list[torch.Generator | None]  # seeded rows' generators, on the batch's device
    # Penalties (None when no request in the batch uses them).
    repetition_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    output_counts: torch.Tensor | None  # [B, V] occurrences in the output so far
    seen_mask: torch.Tensor | None  # [B, V] in prompt or output (repetition penalty)
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) masked out: min_tokens, bad words
    banned_rows: list[int]  # the rows with any ban
    num_logprobs: list[int | None]
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, biases)
    watermark_rows: list[int]
    watermark_prev: list[int]  # the token before each watermarked row's next one
    # structured output: a grammar matcher per row (None: free), an LLMatcher or a verify.MatcherAt
    matchers: list[Any] | None = None
    device: torch.device | None = None  # where the tensors are (from_requests' device)
    # Nothing in it follows the requests' output so far (penalties, min_tokens or bad-word bans,
    # the watermark): the same requests' next step samples with this batch again (SamplingBatches).
    reusable: bool = False

    @classmethod
    def from_requests(
        cls, reqs: Sequence[SamplingRow], vocab_size: int, device: torch.device | str | None = None
    ) -> SamplingBatch:
        """device: the logits' (None: CPU). Small tensors are built on the CPU and each moved in
        one copy; [B, V] ones are scattered on the device from flat index lists."""
        dev = torch.device("cpu") if device is None else torch.device(device)
        if dev.type == "cuda" and dev.index is None:  # "cuda" made concrete ("cuda:0"): generators are keyed by it
            dev = torch.device("cuda", torch.cuda.current_device())
        ps = [r.sampling_params for r in reqs]
        all_greedy = all(p.greedy for p in ps)
        sampling = [p for p in ps if not p.greedy]
        use_top_p = any(p.top_p < 1.0 for p in sampling)
        use_min_p = any(p.min_p > 0.0 for p in sampling)
        use_pen = any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in ps)
        # The per-row float parameters in one tensor: one host-to-device copy (none for a plain
        # greedy batch: a step's every torch call costs tens of us after a decode step's weight
        # stream has evicted the caches).
        floats = [] if all_greedy else [[0.0 if p.greedy else p.temperature for p in ps]]
        floats += [[p.top_p for p in ps]] if use_top_p else []
        floats += [[p.min_p for p in ps]] if use_min_p else []
        if use_pen:
            floats += [
                [p.repetition_penalty for p in ps],
                [p.presence_penalty for p in ps],
                [p.frequency_penalty for p in ps],
            ]
        rows: Iterator[torch.Tensor] = iter(())
        if floats:
            packed = _to(torch.tensor(floats, dtype=torch.float32), dev)
            rows = iter(packed.unbind(0))
        temps = None if all_greedy else next(rows)
        top_p = next(rows) if use_top_p else None
        min_p = next(rows) if use_min_p else None
        top_k: torch.Tensor | None = None
        if any(p.top_k > 0 for p in sampling):
            top_k = _to(torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in ps], dtype=torch.long), dev)

        rep: torch.Tensor | None = None
        pres: torch.Tensor | None = None
        freq: torch.Tensor | None = None
        counts: torch.Tensor | None = None
        seen: torch.Tensor | None = None
        if use_pen:
            rep, pres, freq = next(rows), next(rows), next(rows)
            counts, seen = _penalty_counts(reqs, vocab_size, dev)

        ban_rows: list[int] = []
        ban_ids: list[int] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_vals: list[float] = []
        wm_rows: list[int] = []
        wm_prev: list[int] = []
        banned_rows: list[int] = []
        for i, r in enumerate(reqs):
            p = r.sampling_params
            ids: list[int] = []
            if r.num_output_tokens < p.min_tokens:
                ids = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(r.eos_token_ids))
            ids += _bad_word_bans(r)
            if ids:
                banned_rows.append(i)
                ban_rows += [i] * len(ids)
                ban_ids += ids
            if p.logit_bias:
                bias_rows += [i] * len(p.logit_bias)
                bias_ids += p.logit_bias
                bias_vals += p.logit_bias.values()
            if p.watermark:
                wm_rows.append(i)
                wm_prev.append(r.all_token_ids[-1])
        banned: tuple[torch.Tensor, torch.Tensor] | None = None
        bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if ban_ids:
            idx = _to(torch.tensor([ban_rows, ban_ids], dtype=torch.long), dev)
            banned = (idx[0], idx[1])
        if bias_ids:
            idx = _to(torch.tensor([bias_rows, bias_ids], dtype=torch.long), dev)
            bias = (idx[0], idx[1], _to(torch.tensor(bias_vals, dtype=torch.float32), dev))
        return cls(
            temperature=temps,
            all_greedy=all_greedy,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators=[r.generator_for(dev) for r in reqs],
            repetition_penalty=rep,
            presence_penalty=pres,
            frequency_penalty=freq,
            output_counts=counts,
            seen_mask=seen,
            banned=banned,
            banned_rows=banned_rows,
            num_logprobs=[p.logprobs for p in ps],
            logit_bias=bias,
            watermark_rows=wm_rows,
            watermark_prev=wm_prev,
            matchers=[r.matcher for r in reqs] if any(r.matcher is not None for r in reqs) else None,
            device=dev,
            reusable=not (use_pen or banned_rows or wm_rows or any(r.bad_words_token_ids for r in reqs)),
        )


class SamplingBatches:
    """SamplingBatch.from_requests, but the last step's batch again when the same requests sample
    and it is reusable: a decode step's batch is then the previous one, not rebuilt (at batch 1 its
    Python, run on caches the forward has just evicted, took ~2% of a step)."""

    def __init__(self) -> None:
        self.reqs: list[Request] = []
        self.batch: SamplingBatch | None = None

    def __call__(self, reqs: list[Request], vocab_size: int, device: torch.device) -> SamplingBatch:
        last = self.batch
        if (
            last is not None
            and last.reusable
            and last.device == device
            and len(reqs) == len(self.reqs)
            and all(map(operator.is_, reqs, self.reqs))
        ):
            return last
        self.reqs, self.batch = list(reqs), SamplingBatch.from_requests(reqs, vocab_size, device=device)
        return self.batch


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t, built on the CPU, on device (no call at all on the CPU path). To CUDA from pinned memory:
    a pageable source may make the copy wait for the stream."""
    if device.type == "cpu":
        return t
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


def _penalty_counts(
    reqs: Sequence[SamplingRow], vocab_size: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] output-token counts and prompt-or-output mask, scattered on dev from the flat
    token lists (one copy of B + B + n_out + n_all ints, not two [B, V] tensors)."""
    B = len(reqs)
    lens = [r.num_output_tokens for r in reqs] + [r.num_tokens for r in reqs]
    n_out, n_all = sum(lens[:B]), sum(lens[B:])
    flat = lens + list(chain.from_iterable(r.output_token_ids for r in reqs))
    flat += chain.from_iterable(r.all_token_ids for r in reqs)
    flat_t = _to(torch.tensor(flat, dtype=torch.long), dev)
    lens_t, ids = flat_t[: 2 * B], flat_t[2 * B :]
    row = torch.arange(B, device=dev)
    # output_size: no device-to-host sync to size the result
    out_rows = row.repeat_interleave(lens_t[:B], output_size=n_out)
    all_rows = row.repeat_interleave(lens_t[B:], output_size=n_all)
    counts = torch.zeros(B, vocab_size, dtype=torch.float32, device=dev)
    counts.index_put_((out_rows, ids[:n_out]), torch.ones(n_out, dtype=torch.float32, device=dev), accumulate=True)
    seen = torch.zeros(B, vocab_size, dtype=torch.bool, device=dev)
    seen.index_put_((all_rows, ids[n_out:]), torch.ones((), dtype=torch.bool, device=dev))  # a host scalar would sync
    return counts, seen


def _bad_word_bans(r: SamplingRow) -> list[int]:
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
    token_ids: list[int]  # each row's next token
    logprobs: list[SampleLogprobs | None]
    # Speculative steps: each row's accepted draft tokens, which come before token_ids' (sample/verify.py).
    accepted_ids: list[list[int]] | None = None
    accepted_logprobs: list[list[SampleLogprobs | None]] | None = None

    def tokens_of(self, row: int) -> tuple[list[int], list[SampleLogprobs | None]]:
        """Row's new tokens in order, and their logprobs."""
        if self.accepted_ids is None:
            return [self.token_ids[row]], [self.logprobs[row]]
        assert self.accepted_logprobs is not None  # set with accepted_ids
        return (self.accepted_ids[row] + [self.token_ids[row]], self.accepted_logprobs[row] + [self.logprobs[row]])


def score_tokens(logits: torch.Tensor, targets: list[int], top_n: int) -> list[SampleLogprobs]:
    """Logprob and rank of targets[i] under row i of logits, plus each row's top N."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    tgt = _to(torch.tensor(targets, dtype=torch.long), lp.device)
    return host_logprobs(lp, tgt, [top_n] * len(targets))


def host_logprobs(
    lp: torch.Tensor, chosen: torch.Tensor, top_ns: list[int], extra: torch.Tensor | None = None
) -> list[Any]:
    """Row i's SampleLogprobs for token chosen[i] with its top top_ns[i], computed for all rows
    at once and brought to the host in one copy. `extra` (the sampled ids) rides in the same
    copy and comes back first as a list of ints. float64 carries float32 values and ids exactly."""
    R = len(top_ns)
    tok_lp = lp.gather(1, chosen.unsqueeze(1))
    rank = (lp > tok_lp).sum(dim=-1) + 1
    parts = ([extra] if extra is not None else []) + [tok_lp.squeeze(1), rank]
    n = max(top_ns, default=0)
    if n > 0:
        vals, ids = lp.topk(n, dim=-1)
        parts += [vals.flatten(), ids.flatten()]
    host = torch.cat([t.to(torch.float64) for t in parts]).tolist()
    out: list[Any] = []
    if extra is not None:
        out.append([int(t) for t in host[: len(extra)]])
        host = host[len(extra) :]
    vals_h, ids_h = host[2 * R : 2 * R + R * n], host[2 * R + R * n :]
    out += [
        SampleLogprobs(
            host[i],
            int(host[R + i]),
            [(int(t), v) for t, v in zip(ids_h[i * n : i * n + k], vals_h[i * n : i * n + k])],
        )
        for i, k in enumerate(top_ns)
    ]
    return out


class Sampler:
    """device: where the model's logits are. On the CPU the C++ kernels (`ops`, taken once when
    made: argmax, top-k / top-p cuts) sample them; elsewhere (and for logits on another device)
    torch's ops do, and no CPU kernels are loaded."""

    def __init__(self, seed: int = 0, watermark: WatermarkConfig | None = None, device: torch.device | str = "cpu"):
        self.seed = seed
        self.ops = kernels_for(device, torch.float32)
        self.generator = torch.Generator().manual_seed(seed)  # unseeded rows' noise on CPU
        self._device_generators: dict[torch.device, torch.Generator] = {}  # and on other devices
        self.watermark = watermark or WatermarkConfig()

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self.generator
        g = self._device_generators.get(device)
        if g is None:
            g = self._device_generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return g

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [B, V] float32 from the model, on the device the batch was built for."""
        if batch.device is not None and batch.device != logits.device:
            raise ValueError(
                f"sampling batch built for {batch.device} but the logits are on "
                f"{logits.device}: pass device=logits.device to SamplingBatch.from_requests"
            )
        want = [i for i, n in enumerate(batch.num_logprobs) if n is not None]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want else None
        logits = self.process_logits(logits, batch)
        if batch.all_greedy:
            tokens = argmax_tokens(logits, self.ops)
        else:
            tokens = self._sample(logits, batch)
        if raw_logprobs is None:
            return SamplerOutput(tokens.tolist(), [None] * len(batch.num_logprobs))  # the step's one sync
        if len(want) < len(batch.num_logprobs):
            rows = _to(torch.tensor(want, dtype=torch.long), logits.device)
            raw_logprobs, chosen = raw_logprobs[rows], tokens[rows]
        else:
            chosen = tokens
        token_list, *wanted = host_logprobs(
            raw_logprobs, chosen, [n for n in batch.num_logprobs if n is not None], tokens
        )
        lps: list[SampleLogprobs | None] = [None] * len(token_list)
        for i, lp in zip(want, wanted):
            lps[i] = lp
        return SamplerOutput(token_list, lps)

    def process_logits(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        if (
            b.repetition_penalty is None
            and b.banned is None
            and b.logit_bias is None
            and not b.watermark_rows
            and b.matchers is None
        ):
            return logits
        logits = logits.clone()
        if b.repetition_penalty is not None:
            # set together with repetition_penalty (from_requests' use_pen)
            assert b.seen_mask is not None and b.output_counts is not None
            assert b.frequency_penalty is not None and b.presence_penalty is not None
            rp = b.repetition_penalty.unsqueeze(1)
            penalized = torch.where(logits > 0, logits / rp, logits * rp)
            logits = torch.where(b.seen_mask, penalized, logits)
            logits -= b.frequency_penalty.unsqueeze(1) * b.output_counts
            logits -= b.presence_penalty.unsqueeze(1) * (b.output_counts > 0).float()
        if b.logit_bias is not None:
            rows, ids, values = b.logit_bias
            logits[rows, ids] += values
        if b.watermark_rows:
            apply_watermark(logits, b.watermark_rows, b.watermark_prev, self.watermark)
        # A grammar outranks min_tokens and bad words: a row whose bans leave the grammar no token
        # (e.g. its output is complete but min_tokens bans EOS) takes the grammar's tokens alone.
        fallback = [r for r in b.banned_rows if b.matchers and b.matchers[r] is not None]
        if fallback:
            fb_rows = _to(torch.tensor(fallback, dtype=torch.long), logits.device)
            unbanned = logits[fb_rows]  # advanced indexing: a copy
        if b.banned is not None:
            logits.index_put_(b.banned, torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device))
        if b.matchers is not None:  # last: nothing may bring back a token the grammar forbids
            allowed = apply_grammar_masks(logits, b.matchers)
            if fallback:  # no per-row check on the host: a where over those rows
                assert allowed is not None  # the fallback rows have matchers
                grammar_rows = [i for i, m in enumerate(b.matchers) if m is not None]
                k = _to(torch.tensor([grammar_rows.index(r) for r in fallback], dtype=torch.long), logits.device)
                banned = logits[fb_rows]
                dead = torch.isneginf(banned).all(dim=-1, keepdim=True)
                logits[fb_rows] = torch.where(dead, unbanned.masked_fill(~allowed[k], float("-inf")), banned)
        return logits

    def _sample(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        assert b.temperature is not None  # not all_greedy
        greedy_rows = b.temperature == 0
        greedy_tokens = argmax_tokens(logits, self.ops)
        probs = sampling_probs(logits, b, self.ops)
        sampled = draw_inverse_cdf(probs, b.generators, self._generator_for(probs.device))
        return torch.where(greedy_rows, greedy_tokens, sampled)


def sampling_probs(logits: torch.Tensor, b: SamplingBatch, ops: KernelModule | None = None) -> torch.Tensor:
    """The distribution non-greedy rows sample from: processed logits scaled by temperature and
    truncated by top-k / top-p / min-p (greedy rows: temperature 1, unused). ops: the CPU kernels
    (Sampler.ops) or None."""
    assert b.temperature is not None  # not all_greedy
    temp = torch.where(b.temperature == 0, torch.ones_like(b.temperature), b.temperature)
    logits = logits / temp.unsqueeze(1)
    if b.top_k is not None or b.top_p is not None:
        logits = _top_k_top_p(logits, b.top_k, b.top_p, ops)
    probs = torch.softmax(logits, dim=-1)
    if b.min_p is not None:
        thresh = b.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < thresh, 0.0)
    return probs


def _on_kernels(ops: KernelModule | None, logits: torch.Tensor) -> TypeGuard[KernelModule]:
    """Whether these logits go through the CPU kernels `ops` (float32 rows on the CPU)."""
    return ops is not None and logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2


def argmax_tokens(logits: torch.Tensor, ops: KernelModule | None = None) -> torch.Tensor:
    """Each row's first largest logit's index: the C++ kernel on CPU (ops, Sampler.ops: one pass;
    torch's max over 32 x 49152 takes ~1.3 ms on 2 cores), else torch (max is faster than argmax,
    same tie rule)."""
    if _on_kernels(ops, logits):
        return ops.argmax_rows(logits)
    return logits.max(dim=-1).indices


def _top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, ops: KernelModule | None = None
) -> torch.Tensor:
    """The logits with every token outside the row's top k, then outside its top-p nucleus, at
    -inf. On CPU each row's cut comes from the C++ kernel (csrc/sampling.cpp: one pass and a
    small sort; torch's sort of 32 x 49k logits takes ~60 ms on 2 cores, more than a decode
    step), which keeps every token tied with the last one kept; elsewhere from the sort."""
    if _on_kernels(ops, logits):
        return ops.top_k_top_p(logits, top_k, top_p)
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


def per_row(
    draw: Callable[[torch.Tensor, torch.Generator | None], torch.Tensor],
    like: torch.Tensor,
    gens: list[torch.Generator | None],
    own: torch.Generator | None,
) -> torch.Tensor:
    """A tensor shaped like `like`, row r filled by draw(row, gens[r]); rows without a generator in
    one draw from `own`."""
    out = torch.empty_like(like)
    shared = [r for r, g in enumerate(gens) if g is None]
    if len(shared) == len(gens):
        draw(out, own)
    elif shared:
        out[torch.tensor(shared, dtype=torch.long, device=like.device)] = draw(
            torch.empty((len(shared),) + tuple(like.shape[1:]), dtype=like.dtype, device=like.device), own
        )
    for r, g in enumerate(gens):
        if g is not None:
            draw(out[r], g)
    return out


def draw_inverse_cdf(
    dist: torch.Tensor, gens: list[torch.Generator | None], own: torch.Generator | None
) -> torch.Tensor:
    """One token per row of dist by inverse CDF, row r's uniform from gens[r] (or `own`)."""
    u = per_row(
        lambda t, g: t.uniform_(generator=g),
        torch.empty(len(gens), 1, dtype=torch.float64, device=dist.device),
        gens,
        own,
    )
    return inverse_cdf(dist, u)


CDF_BLOCK = 256


def inverse_cdf(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row r's token whose cumulative-mass interval [c_{t-1}, c_t) holds u[r] * (row mass): one
    uniform per row (V exponentials per row cost ~30 ms for 32 rows at V = 49k on 2 CPU cores,
    about a decode step of SmolLM2 at that batch). Two levels, because a float64 cumsum over V is
    sequential and slow on CPU (~9 ms for 32 x 49k): block masses (a vectorised sum), the block by
    a cumsum over the blocks, then a cumsum inside that one block. A zero-mass token has an empty
    interval and is never drawn."""
    R, V = dist.shape
    nb = -(-V // CDF_BLOCK)
    d = dist if nb * CDF_BLOCK == V else torch.nn.functional.pad(dist, (0, nb * CDF_BLOCK - V))
    blocks = d.view(R, nb, CDF_BLOCK)
    # float32 block sums (pairwise: ~1e-7 relative, the inputs' own precision), float64 from there on.
    cb = blocks.sum(dim=2).double().cumsum(dim=1)
    target = _below(u * cb[:, -1:], cb[:, -1:])  # u * mass may round up to the mass itself
    b = torch.searchsorted(cb, target, right=True).clamp_(max=nb - 1)  # [R, 1]: a block with mass
    before = torch.where(b > 0, cb.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
    cw = blocks[torch.arange(R, device=dist.device), b.squeeze(1)].double().cumsum(dim=1)
    # The block's own cumsum may round differently from its sum: stay inside its last interval.
    t = torch.searchsorted(cw, _below((target - before).clamp_(min=0.0), cw[:, -1:]), right=True)
    return (b * CDF_BLOCK + t).squeeze(1)


def _below(x: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """x, kept strictly below limit (limit > 0)."""
    return torch.minimum(x, torch.nextafter(limit, torch.zeros_like(limit)))
