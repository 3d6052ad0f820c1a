"""Gemma 2 and Gemma 3 (text) decoders: Llama's pieces (fused q/k/v and gate/up projections, rotary
embeddings, weight loading) with what Gemma does differently, as transformers computes it:

- embeddings scaled by sqrt(hidden_size), the factor rounded to the model's dtype first;
- RMSNorm by (1 + w), that factor kept in float32 (GemmaRMSNorm), before and after both the
  attention and the MLP (four norms a layer);
- a GeGLU MLP: gelu (tanh approximation) of the gate times up;
- attention scaled by query_pre_attn_scalar ** -0.5, sliding-window layers interleaved with global
  ones (config.layer_types; sliding_window_pattern in older configs becomes layer_types when
  transformers reads them), Gemma 2's scores soft-capped (attn_logit_softcapping): the attention
  backend applies each layer's window, cap and scale (LayerAttention);
- Gemma 3: an RMSNorm on each head's q and k before rope, and its own rope on sliding layers
  (rope_parameters["sliding_attention"], from rope_local_base_freq);
- the logits soft-capped (final_logit_softcapping), here in float32.

The KV manager keeps every block of these models (their global layers read all keys).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.comm import NO_TP, TPGroup
from tokenmill.model.layers.attention import AttentionBackend, AttentionMetadata, LayerAttention
from tokenmill.model.layers.embedding import embedding
from tokenmill.model.layers.rotary import RotaryEmbedding
from tokenmill.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, sliding_windows
from tokenmill.model.sharding import lm_head_rows, sharding_rule


@sharding_rule("replicated (q/k norms: each rank normalizes its own heads)")
class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), in float32 and rounded once (the C++ kernels take the float32 factor).
    `ops`: the kernels bound at load (layers/bind.py; None: torch)."""

    ops = None

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self._factor, self._key = None, None

    def factor(self) -> torch.Tensor:
        """1 + weight in float32, made again whenever the weight changes (loaded, cast, moved)."""
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if key != self._key:
            self._factor, self._key = 1.0 + w.detach().float(), key
        return self._factor

    def bind_kernels(self, ops, epilogues: bool = True) -> None:
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """As RMSNorm.forward: with `residual`, (norm(x + residual), x + residual), x then reused."""
        ops, w = self.ops, self.factor()
        if residual is not None:
            if ops is not None and x.is_contiguous() and residual.is_contiguous():
                ops.fused_add_rms_norm(x, residual, w, self.eps)
                return x, residual
            residual = x + residual
            return self(residual), residual
        if ops is not None:
            return ops.rms_norm(x.contiguous(), w, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * w).to(x.dtype)


@sharding_rule(
    "as LlamaMLP's: gate/up column-parallel, down_proj row-parallel, then an all-reduce",
    covers=("gate_up_proj", "down_proj"),
)
class GemmaMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None:
            return self.tp.all_reduce(self.down_proj(self.ops.gelu_tanh_and_mul(gate_up)))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.gelu(gate, approximate="tanh") * up))


@sharding_rule(
    "as LlamaAttention's: q/k/v by whole heads, o_proj row-parallel, then an all-reduce", covers=("qkv_proj", "o_proj")
)
class GemmaAttention(LlamaAttention):
    def __init__(self, cfg, layer_idx: int, qk_norm: bool, tp: TPGroup = NO_TP):
        bias = bool(getattr(cfg, "attention_bias", False))
        super().__init__(cfg, layer_idx, qkv_bias=bias, tp=tp)
        if bias:  # Gemma's o_proj has a bias whenever q/k/v do
            self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=True)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.q_norm is None:  # Gemma 2: Llama's attention (the backend adds the window, cap and scale)
            return super().forward(x, positions, rope, attn, meta)
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim))
        q, k = rope(positions, q, k)
        out = attn.forward(self.layer_idx, q, k, v.reshape(T, self.num_kv_heads, self.head_dim), meta)
        return self.tp.all_reduce(self.o_proj(out))


@sharding_rule("a container")
class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, qk_norm: bool, rope_key: str, tp: TPGroup = NO_TP):
        super().__init__()
        self.rope_key = rope_key  # which of the model's rotary tables this layer uses
        self.self_attn = GemmaAttention(cfg, layer_idx, qk_norm, tp)
        self.mlp = GemmaMLP(cfg, tp)
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            setattr(self, name, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def forward(self, x, residual, positions, rope, attn, meta):
        """(x, residual) -> (x, residual) as LlamaDecoderLayer: each residual add fuses into the norm after it."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, positions, rope, attn, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


@sharding_rule(
    "the LM head by vocab rows, gathered on rank 0 (soft-capped there)",
    covers=("lm_head",),
    methods=("compute_logits",),
)
class GemmaForCausalLM(LlamaForCausalLM):
    # HF architectures this class serves: whether the layers have q/k norms and per-type ropes (Gemma 3).
    ARCHITECTURES = {"Gemma2ForCausalLM": False, "Gemma3ForCausalLM": True}

    def __init__(self, cfg, dtype: torch.dtype, max_position: int, tp: TPGroup = NO_TP):
        nn.Module.__init__(self)
        arch = cfg.architectures[0]
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"{arch}: hidden activation {act!r} is not supported (gelu_pytorch_tanh is)")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError(f"{arch}: use_bidirectional_attention (an embedding model) is not supported")
        self.tp, self.cfg, self.max_position = tp, cfg, max_position
        self.gemma3 = self.ARCHITECTURES[arch]
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        # transformers multiplies by sqrt(hidden) cast to the weights' dtype (55.4256 -> 55.5 in bf16).
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5, dtype=dtype, device="cpu"))
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i, self.gemma3, types[i], tp) for i in range(len(types)))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.lm_head = nn.Linear(cfg.hidden_size, lm_head_rows(cfg.vocab_size, tp.size), bias=False)
        if self.tie_word_embeddings and tp.size == 1:  # split: load_weights copies this rank's rows
            self.lm_head.weight = self.embed_tokens.weight
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self.rope = self.make_rope(dtype)

    @property
    def attention_layers(self) -> list[LayerAttention]:
        cfg = self.cfg
        # transformers' Gemma 3 attention never passes attn_logit_softcapping on: neither do we.
        softcap = None if self.gemma3 else getattr(cfg, "attn_logit_softcapping", None)
        scale = cfg.query_pre_attn_scalar**-0.5
        return [LayerAttention(w, softcap, scale) for w in sliding_windows(cfg, self.max_position)]

    def make_rope(self, dtype: torch.dtype) -> nn.ModuleDict:
        """A rotary table per layer type: Gemma 3 keeps rope parameters per type, Gemma 2 one set."""
        cfg = self.cfg
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        params = getattr(cfg, "rope_parameters", None) or {}

        def table(p: dict, default_theta: float) -> RotaryEmbedding:
            return RotaryEmbedding(head_dim, self.max_position, p.get("rope_theta", default_theta), p, dtype)

        if "full_attention" in params:  # transformers >= 5: one dict per layer type
            return nn.ModuleDict({t: table(p, 10000.0) for t, p in params.items()})
        theta = getattr(cfg, "rope_theta", 10000.0)  # older configs: flat parameters
        full = table(params or getattr(cfg, "rope_scaling", None) or {}, theta)
        local = table({}, getattr(cfg, "rope_local_base_freq", theta)) if self.gemma3 else full
        return nn.ModuleDict({"full_attention": full, "sliding_attention": local})

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, meta: AttentionMetadata
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids) * self.embed_scale, None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rope[layer.rope_key], attn, meta)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits of these rows, soft-capped; under tensor parallelism on rank 0 only (None elsewhere)."""
        logits = self.tp.gather_to_first(self.lm_head(self.norm(hidden)).float())
        if logits is None:
            return None
        if self.tp.size > 1:
            logits = logits[:, : self.cfg.vocab_size]
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
