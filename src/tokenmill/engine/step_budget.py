"""How many prompt tokens a step may take while other requests are decoding.

A fixed token budget makes a step's time depend on the machine: 2,048 prompt tokens take a few
milliseconds on a GPU and seconds on two CPU cores, and every request streaming tokens waits that
long for its next one. So while any request decodes, the prompt tokens of a step (chunks of
prompts being prefilled, new prompts admitted) are sized from the time steps take here: a step's
time is modelled as its decode part plus a cost per prompt token, both measured on the last steps
(the cost per prompt token grows as a prompt's context grows, and the newest steps count most),
and the step gets the prompt tokens that keep it within the target inter-token latency. When
nothing decodes, a step takes the whole token budget (prefill throughput is unchanged).

Sarathi-Serve's stall-free batching and SLO-aware schedulers do the same with a budget profiled
offline; here it is measured as the engine runs, per machine and model, so it needs no profiling.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepBudget:
    target_s: float  # the inter-token latency to keep while prompts are prefilled (<= 0: off)
    max_tokens: int  # the scheduler's token budget (max_num_batched_tokens)
    min_tokens: int = 16  # prompt tokens a step always gets, so that a prefill always progresses
    # weight of the newest step in the running estimates: high, so that a prompt's growing context
    # (and a costlier request, prompt logprobs say) shows within a step or two
    alpha: float = 0.5
    decode_s: float | None = None  # a step's time without prompt tokens
    token_s: float | None = None  # seconds per prompt token, on top of the decode part
    last_prefill: int = 0  # prompt tokens of the last step that had any while decoding

    @property
    def enabled(self) -> bool:
        return self.target_s > 0

    def prefill_tokens(self, decoding: bool) -> int:
        """Prompt tokens the next step may take: the whole budget when no request decodes, else
        those that keep the step within the target. Until a cost is measured, and after a step
        within the target, it grows by at most 2x a step (one wrong estimate cannot make a long
        step); a step over the target shrinks it at once."""
        if not decoding or not self.enabled:
            return self.max_tokens
        if self.token_s is None:
            want = self.min_tokens
        else:
            spare = self.target_s - (self.decode_s or 0.0)
            if spare <= 0:
                want = self.min_tokens
            else:
                want = int(spare / self.token_s) if self.token_s > 0 else self.max_tokens
        if self.last_prefill:
            want = min(want, 2 * self.last_prefill)
        return max(self.min_tokens, min(self.max_tokens, want))

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        """One step's figures: its prompt tokens, its decode rows, its time."""
        if prefill_tokens == 0:
            if decode_rows:
                self.decode_s = self._mix(self.decode_s, seconds)
            return
        per_token = max(seconds - (self.decode_s or 0.0), 0.0) / prefill_tokens
        self.token_s = self._mix(self.token_s, per_token)
        if decode_rows:
            self.last_prefill = prefill_tokens

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)
