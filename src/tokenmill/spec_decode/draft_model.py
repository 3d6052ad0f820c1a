"""Draft-model speculation: a smaller model with the target's vocabulary proposes the drafts.

The draft has its own ModelRunner (its weights in its own dtype and quantization, its own KV cache
tensor, the same attention kernels and fused step as the target) and its own block pool, so its
KV never competes with the target's. Per request it remembers how many of the request's tokens
its cache holds. Drafting k tokens for a batch of requests is k forward passes of the draft:
- pass 0 feeds each request's tokens the draft has not seen yet (its prompt the first time, then
  the tokens verification accepted since; at most `max_num_batched_tokens` in all, the rest next
  step, so a long prompt never stalls the engine) and drafts the token after them;
- pass j feeds draft j and drafts j + 1, for the requests that want more.
The last draft is never fed, and rejected drafts' K/V is overwritten later: at the next call the
cache holds the tokens up to where the fed drafts stop matching what was verified.

Drafts are the draft model's argmax for greedy requests and requests with a grammar (one-hot q:
a draft the grammar forbids is cut, which stays exact for one-hot drafts), and samples of
softmax(logits / temperature) for the others, whose probabilities go to verification as q
(rejection sampling then keeps the output distribution the target's, whatever q is).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from tokenmill.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, parse_dtype
from tokenmill.kv_cache import BlockPool, KVBlock
from tokenmill.model.layers.attention import SeqChunk
from tokenmill.model.loader import load_hf_config, resolve_model_path
from tokenmill.request import Request
from tokenmill.spec_decode.drafts import Drafts
from tokenmill.worker.runner import ModelRunner
from tokenmill.worker.staging import StepInputs

logger = logging.getLogger("tokenmill")


@dataclass
class _DraftSeq:
    """One request in the draft's cache: its blocks, the tokens whose K/V is there for sure
    (`num_computed`), and the drafts fed after them last call (valid while they were accepted)."""

    blocks: list[KVBlock] = field(default_factory=list)
    num_computed: int = 0
    fed_drafts: list[int] = field(default_factory=list)

    def sync(self, tokens: list[int]) -> None:
        """Counts the fed drafts that verification accepted as computed."""
        n = self.num_computed
        for d in self.fed_drafts:
            if n >= len(tokens) or tokens[n] != d:
                break
            n += 1
        self.num_computed, self.fed_drafts = min(n, len(tokens) - 1), []


class DraftModelProposer:
    def __init__(
        self,
        model: str,
        quantization: str | None,
        dtype: str | None,
        target: ModelConfig,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        device: DeviceConfig,
        seed: int = 0,
    ):
        path = resolve_model_path(model)
        hf = load_hf_config(path)
        vocab = getattr(hf, "vocab_size", None)
        if vocab != target.vocab_size:
            raise ValueError(
                f"speculative draft model {model!r} has a vocabulary of {vocab} tokens, the target "
                f"{target.vocab_size}: a draft model must share the target's vocabulary"
            )
        _check_same_tokenizer(path, target.path, model)
        max_len = min(target.max_model_len, getattr(hf, "max_position_embeddings", target.max_model_len))
        config = ModelConfig(
            path,
            hf,
            parse_dtype(dtype, target.device) if dtype else target.dtype,
            max_len,
            f"draft:{model}",
            target.device,
            "auto",
            quantization,
        )
        self.block_size = bs = cache.block_size
        # As many tokens as the target's pool holds, plus a block per request for the drafts beyond.
        num_blocks = cache.num_blocks + scheduler.max_num_seqs + 1
        self.runner = ModelRunner(config, num_blocks, bs, seed, device_config=device, scheduler_config=scheduler)
        self.pool = BlockPool(num_blocks)
        self.max_model_len = max_len
        self.max_prefill_tokens = scheduler.max_num_batched_tokens
        self.generator = torch.Generator(self.runner.device).manual_seed(seed + 1)
        self._seqs: dict[str, _DraftSeq] = {}
        logger.info(
            "speculative draft model %s: %s, %s, KV cache %d blocks (%.2f GiB)",
            model,
            config.dtype,
            quantization or "unquantized",
            num_blocks,
            num_blocks * bs * config.kv_bytes_per_token() / 2**30,
        )

    # ---- the proposer interface (drafter.py) ----------------------------------------
    def propose_many(self, items: list[tuple[Request, int]], rows_left: int, running: list[Request]) -> list[Drafts]:
        """Drafts for each (request, k) in items, at most rows_left in all, the first items first
        (none for a request still catching up or whose cache has no room)."""
        out = [Drafts([]) for _ in items]
        plan = self._plan(items, rows_left, running)
        if not plan:
            return out
        active = plan  # (index in items, request, seq, tokens fed in pass 0, k)
        drafts: dict[int, list[int]] = {i: [] for i, *_ in plan}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, *_ in plan}
        step = 0
        while active:
            feeds = [
                (seq, req.all_token_ids[seq.num_computed : seq.num_computed + n] if step == 0 else [drafts[i][-1]])
                for i, req, seq, n, _k in active
            ]
            logits = self._forward(feeds)
            for (_i, _req, seq, _n, _k), (_, fed) in zip(active, feeds):
                if step > 0:
                    seq.fed_drafts.append(fed[0])
                seq.num_computed += len(fed)
            sampling = [
                j for j, a in enumerate(active) if a[4] and not a[1].sampling_params.greedy and a[1].matcher is None
            ]
            tokens = logits.argmax(dim=-1)
            if sampling:
                self._sample(active, logits, sampling, tokens, probs)
            for (i, _req, _seq, _n, _k), tok in zip(active, tokens.tolist()):
                drafts[i].append(tok)
            step += 1
            active = [a for a in active if a[4] > step]
        for i, _req, seq, _n, k in plan:
            if k:  # K/V holds the tokens before the drafts surely; the fed drafts while accepted
                seq.num_computed -= len(seq.fed_drafts)
                out[i] = Drafts(drafts[i][:k], torch.stack(probs[i])[:k] if probs[i] else None)
            else:  # still catching up: nothing drafted, nothing fed beyond the request's tokens
                seq.fed_drafts = []
        return out

    def add_tokens(self, req: Request, tokens: list[int]) -> None:
        pass  # synced lazily at the next proposal

    def finish(self, req: Request) -> None:
        seq = self._seqs.pop(req.request_id, None)
        if seq is not None and seq.blocks:
            self.pool.free_blocks(list(reversed(seq.blocks)))

    # ---- internals ---------------------------------------------------------------------
    def _plan(self, items: list[tuple[Request, int]], rows_left: int, running: list[Request]) -> list[tuple]:
        """Per request: how many of its tokens pass 0 feeds and how many drafts (0 while it is still
        catching up), with the slots allocated; the catch-up shares one token budget."""
        budget = self.max_prefill_tokens
        plan = []
        for i, (req, k) in enumerate(items):
            seq = self._seqs.setdefault(req.request_id, _DraftSeq())
            seq.sync(req.all_token_ids)
            behind = req.num_tokens - seq.num_computed
            k = min(k, self.max_model_len - req.num_tokens, rows_left)
            if budget <= 0 or k <= 0:
                continue
            n = min(behind, budget)
            if n < behind:
                k = 0  # the rest of the catch-up next step
            if not self._allocate(seq, seq.num_computed + n + max(k - 1, 0), req, running):
                continue
            budget -= n
            rows_left -= k
            plan.append((i, req, seq, n, k))
        return plan

    def _allocate(self, seq: _DraftSeq, num_tokens: int, req: Request, running: list[Request]) -> bool:
        need = -(-num_tokens // self.block_size) - len(seq.blocks)
        if need > self.pool.num_free_blocks:  # what requests no longer running hold goes first
            live = {r.request_id for r in running}
            for rid in [rid for rid in self._seqs if rid not in live and rid != req.request_id]:
                s = self._seqs.pop(rid)
                self.pool.free_blocks(list(reversed(s.blocks)))
        if need > self.pool.num_free_blocks:
            return False
        if need > 0:
            seq.blocks.extend(self.pool.get_new_blocks(need))
        return True

    def _forward(self, feeds: list[tuple[_DraftSeq, list[int]]]) -> torch.Tensor:
        """One pass of the draft: each sequence's tokens after its computed ones; float32 logits of
        each sequence's last row."""
        bs = self.block_size
        input_ids, positions, slots, seqs, last = [], [], [], [], []
        for seq, toks in feeds:
            start, table = seq.num_computed, [b.block_id for b in seq.blocks]
            seqs.append(SeqChunk(len(input_ids), len(toks), start, table))
            input_ids.extend(toks)
            pos = range(start, start + len(toks))
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            last.append(len(input_ids) - 1)
        r = self.runner
        step = StepInputs(
            torch.tensor(input_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            r.attn.build_metadata(seqs, slots, bs),
            torch.tensor(last, dtype=torch.long),
        )
        logits, _ = r.run(r.to_device(step))
        return logits

    def _sample(
        self,
        active: list[tuple],
        logits: torch.Tensor,
        rows: list[int],
        tokens: torch.Tensor,
        probs: dict[int, list[torch.Tensor]],
    ) -> None:
        """Sampled drafts for `rows`: q is the draft's distribution under the request's temperature,
        top-k and top-p (the closer q is to the target's p, the more is accepted), drawn by inverse
        CDF with the request's seeded generator (else the draft's own)."""
        for j in rows:
            i, req = active[j][0], active[j][1]
            q = _processed_probs(logits[j], req.sampling_params)
            gen = req.generator_for(q.device) or self.generator
            u = torch.rand((), generator=gen, device=q.device)
            tok = int(torch.searchsorted(torch.cumsum(q, 0), u.reshape(1)).clamp_(max=q.numel() - 1))
            tokens[j] = tok
            probs[i].append(q)


def _processed_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """softmax(logits / temperature) restricted to the top-k and the top-p nucleus, normalised."""
    x = logits / params.temperature
    if 0 < params.top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, params.top_k).values[-1], float("-inf"))
    q = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        p, idx = q.sort(descending=True)
        q[idx[(p.cumsum(0) - p) > params.top_p]] = 0.0  # keeps the token that crosses top_p
        q /= q.sum()
    return q


def _check_same_tokenizer(draft_path: str, target_path: str, name: str) -> None:
    """Refuses a draft whose tokenizer maps tokens differently (same size, other vocabulary)."""
    files = [os.path.join(p, "tokenizer.json") for p in (draft_path, target_path)]
    if not all(os.path.exists(f) for f in files):
        return
    from tokenizers import Tokenizer

    draft, target = (Tokenizer.from_file(f).get_vocab() for f in files)
    if draft != target:
        diff = sum(1 for t, i in draft.items() if target.get(t) != i)
        raise ValueError(
            f"speculative draft model {name!r}: its tokenizer differs from the target's on {diff} "
            f"tokens; a draft model must share the target's vocabulary"
        )
