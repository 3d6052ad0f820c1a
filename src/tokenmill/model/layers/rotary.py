"""Rotary position embeddings (neox / HF "rotate_half" layout): linear, Llama 3 and LongRoPE (Phi-3)
scaling, and partial rotary (only the first rotary_dim dimensions of each head turn)."""

from __future__ import annotations

import math

import torch

# The tables are computed on the CPU whatever the ambient device: under the loader's
# torch.device("meta") the same ops would run torch's Python meta decompositions, whose first use
# imports torch._dynamo (~2 s of a warm start); the loader computes them again after loading.
_TABLE_DEVICE = "cpu"


def _inv_freq(head_dim: int, base: float, scaling: dict | None, max_position: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, factor on cos and sin) as transformers computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=_TABLE_DEVICE).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind in ("longrope", "su"):
        return _longrope(exponents, base, scaling, max_position)
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, stretch low ones by `factor`, blend in between.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3, longrope")


def _longrope(exponents: torch.Tensor, base: float, scaling: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): one stretch factor per frequency, the long ones when the engine's context
    (max_position) exceeds the pretrained one. transformers switches per forward pass on the
    longest position seen, which would leave cached keys rotated with the other set; like vLLM
    and llama.cpp we choose once, by context size. cos and sin carry the attention factor."""
    orig = scaling["original_max_position_embeddings"]
    factors = scaling["long_factor"] if max_position > orig else scaling["short_factor"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / orig
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1.0 else 1.0
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=_TABLE_DEVICE) * base**exponents), attention_factor


class RotaryEmbedding(torch.nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict | None,
        dtype: torch.dtype,
        rotary_dim: int | None = None,
    ):
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim or head_dim
        inv_freq, mscale = _inv_freq(self.rotary_dim, base, scaling, max_position)
        t = torch.arange(max_position, dtype=torch.float32, device=_TABLE_DEVICE)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # Cached in the compute dtype, as HF casts cos/sin to the activations' dtype.
        self.register_buffer("cos", (emb.cos() * mscale).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * mscale).to(dtype), persistent=False)

    @property
    def fusable(self) -> bool:
        """Whether the C++ kernels (attention's rope_and_cache, the fused decode step) can apply it:
        they turn whole heads."""
        return self.rotary_dim == self.head_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        if self.rotary_dim < self.head_dim:  # the rest of each head passes through
            r = self.rotary_dim
            return (
                torch.cat((q[..., :r] * cos + _rotate_half(q[..., :r]) * sin, q[..., r:]), -1),
                torch.cat((k[..., :r] * cos + _rotate_half(k[..., :r]) * sin, k[..., r:]), -1),
            )
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
