"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a flat token batch.

Plain PyTorch, read top to bottom. Q/K/V and gate/up projections are fused into one matmul
each; `load_weights` maps Hugging Face tensor names onto the fused parameters.

Tensor parallel (`tp`, distributed/): each rank builds the same model with its share of the
heads and of the MLP's intermediate size and reads only its slices of the checkpoint
(model/sharding.py); o_proj and down_proj are followed by an all-reduce, and the LM head's
vocab slices are gathered on rank 0. With a group of one both are no-ops.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.comm import NO_TP, TPGroup
from tokenmill.model.layers.attention import AttentionBackend, AttentionMetadata, LayerAttention
from tokenmill.model.layers.embedding import embedding
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.quantization import GROUP, QuantEmbedding, QuantLinear
from tokenmill.model.layers.rotary import RotaryEmbedding
from tokenmill.model.sharding import lm_head_rows, sharding_rule


@sharding_rule(
    "q/k/v column-parallel by whole heads, o_proj row-parallel, then an all-reduce", covers=("qkv_proj", "o_proj")
)
class LlamaAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, qkv_bias: bool, tp: TPGroup = NO_TP):
        super().__init__()
        self.layer_idx, self.tp = layer_idx, tp
        heads = cfg.num_attention_heads
        self.num_heads = heads // tp.size  # this rank's heads
        self.num_kv_heads = (getattr(cfg, "num_key_value_heads", None) or heads) // tp.size
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        # HF gives o_proj a bias with attention_bias (Llama, Qwen3), never for Qwen2's q/k/v biases.
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=getattr(cfg, "attention_bias", False))

    def prepare_qkv(self, qkv: torch.Tensor) -> torch.Tensor:
        """The fused projection's output before rope: a family's own step goes here (Qwen3's q/k norms)."""
        return qkv

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.prepare_qkv(self.qkv_proj(x))
        if rope.fusable and attn.fuses_rope(qkv):  # rotary embedding and the K/V cache write in one kernel
            q = attn.rope_and_cache(self.layer_idx, qkv, positions, rope.cos, rope.sin, meta)
            return self.tp.all_reduce(self.o_proj(attn.forward(self.layer_idx, q, None, None, meta)))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        return self.tp.all_reduce(self.o_proj(attn.forward(self.layer_idx, q, k, v, meta)))


@sharding_rule(
    "gate/up column-parallel, down_proj row-parallel, then an all-reduce", covers=("gate_up_proj", "down_proj")
)
class LlamaMLP(nn.Module):
    """SwiGLU over a fused gate/up projection. Bound at load (layers/bind.py): `ops` (the
    silu_and_mul kernel; None: torch) and `fused_act`, whether the projection computes the
    activation in its epilogue (PackedLinear / W8A8Linear.fuses_silu): decided then, from the
    projection the model holds (a LoRA-wrapped one has no epilogue; a reference model whose hooks
    watch the projection's forward binds with epilogues=False)."""

    ops = None
    fused_act = False

    def __init__(self, cfg, tp: TPGroup = NO_TP, intermediate_size: int | None = None):
        super().__init__()
        self.tp = tp
        self.intermediate = (intermediate_size or cfg.intermediate_size) // tp.size  # this rank's share
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = nn.Linear(self.intermediate, cfg.hidden_size, bias=bias)

    def bind_kernels(self, ops, epilogues: bool = True) -> None:
        self.ops = ops
        self.fused_act = epilogues and bool(getattr(self.gate_up_proj, "fuses_silu", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_act:  # the activation in the projection's epilogue
            return self.tp.all_reduce(self.down_proj(self.gate_up_proj.silu_and_mul(x)))
        gate_up = self.gate_up_proj(x)
        if self.ops is not None:
            return self.tp.all_reduce(self.down_proj(self.ops.silu_and_mul(gate_up)))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


@sharding_rule("a container")
class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention  # a family with its own attention subclasses the layer and sets this

    def __init__(self, cfg, layer_idx: int, qkv_bias: bool, tp: TPGroup = NO_TP):
        super().__init__()
        self.self_attn = self.attention_cls(cfg, layer_idx, qkv_bias, tp)
        self.mlp = self.make_mlp(cfg, layer_idx, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_mlp(self, cfg, layer_idx: int, tp: TPGroup) -> nn.Module:
        """The feed-forward block; a family with another (a mixture of experts) overrides this."""
        return LlamaMLP(cfg, tp)

    def forward(self, x, residual, positions, rope, attn, meta):
        """(x, residual) -> (x, residual): the residual stream is carried separately so that each
        add fuses into the norm after it; residual is None on the first layer."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, attn, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


@sharding_rule("the LM head by vocab rows, gathered on rank 0", covers=("lm_head",), methods=("compute_logits",))
class LlamaForCausalLM(nn.Module):
    # HF architectures this class serves, and whether their q/k/v projections carry a bias.
    ARCHITECTURES = {
        "LlamaForCausalLM": False,
        "MistralForCausalLM": False,
        "Qwen2ForCausalLM": True,
    }
    # What the engine may do with a model follows from its modules: the fused C++ decode step
    # (worker/fused_decode.py), tensor parallelism (model/sharding.py's rules), LoRA (lora/layers.py).
    decoder_layer_cls = LlamaDecoderLayer

    def __init__(self, cfg, dtype: torch.dtype, max_position: int, tp: TPGroup = NO_TP):
        super().__init__()
        self.tp = tp
        arch = (getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])[0]
        qkv_bias = self.ARCHITECTURES.get(arch, False) or getattr(cfg, "attention_bias", False)
        self.cfg = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer_cls(cfg, i, qkv_bias, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(cfg.hidden_size, lm_head_rows(cfg.vocab_size, tp.size), bias=False)
        if self.tie_word_embeddings and tp.size == 1:  # split: load_weights copies this rank's rows
            self.lm_head.weight = self.embed_tokens.weight
        self.max_position = max_position
        self.rope = self.make_rope(dtype)

    @property
    def attention_layers(self) -> list[LayerAttention]:
        """How each layer attends (the attention backend's per-layer windows)."""
        return [LayerAttention(sliding_window=w) for w in sliding_windows(self.cfg, self.max_position)]

    def make_rope(self, dtype: torch.dtype) -> RotaryEmbedding:
        """Rotary tables; the loader calls this again after materialising a meta-device model."""
        cfg = self.cfg
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # transformers >= 5 keeps theta and scaling in rope_parameters; older ones split them.
        params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
        theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0)
        for key in ("max_position_embeddings", "original_max_position_embeddings"):  # longrope's defaults
            if getattr(cfg, key, None):
                params.setdefault(key, getattr(cfg, key))
        return RotaryEmbedding(head_dim, self.max_position, theta, params, dtype, int(head_dim * partial))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Returns the final hidden states [T, hidden]; call compute_logits on the rows needed."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rope, attn, meta)
        return x + residual

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm's output: what the LM head reads, and what pooling (embeddings) reads."""
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits of these rows; under tensor parallelism on rank 0 only (None elsewhere)."""
        logits = self.tp.gather_to_first(self.lm_head(self.norm(hidden)).float())
        return logits[:, : self.cfg.vocab_size] if logits is not None and self.tp.size > 1 else logits

    # ---- weights ---------------------------------------------------------------------
    def load_quantized(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> set[str]:
        """Install pre-quantized weights (`<hf name>.qweight` / `.scales`, e.g. GGUF Q4_1 blocks)
        as QuantLinear / QuantEmbedding, fusing q/k/v and gate/up by stacking their rows. A fused
        layer whose parts are not all quantized alike stays dense. Returns the HF names consumed."""
        shards: dict[str, list[tuple[int, str, int, torch.Tensor, torch.Tensor]]] = {}
        for key, qweight in tensors.items():
            if not key.endswith(".qweight"):
                continue
            stem = key.removesuffix(".qweight")
            name = stem.removeprefix("model.") + ".weight"
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target, shard = self.fused_target(name)
            bits = 4 if qweight.dtype == torch.uint8 else 8
            shards.setdefault(target.removesuffix(".weight"), []).append(
                ((shard or (0, 0))[0], stem + ".weight", bits, qweight, tensors[stem + ".scales"])
            )
        used: set[str] = set()
        for path, parts in shards.items():
            parent_path, _, child = path.rpartition(".")
            parent = self.get_submodule(parent_path) if parent_path else self
            module, bits = getattr(parent, child), {p[2] for p in parts}
            parts.sort(key=lambda p: p[0])
            qweight, scales = torch.cat([p[3] for p in parts]), torch.cat([p[4] for p in parts])
            if len(bits) != 1 or module.weight.shape[0] != qweight.shape[0] or module.weight.shape[1] % GROUP:
                continue
            if isinstance(module, nn.Embedding):
                setattr(parent, child, QuantEmbedding(qweight, scales, bits.pop(), dtype))
                if self.tie_word_embeddings:
                    self.lm_head = QuantLinear(qweight, scales, self.embed_tokens.bits)
            else:
                bias = module.bias.detach() if module.bias is not None else None  # loaded later, by name
                setattr(parent, child, QuantLinear(qweight, scales, bits.pop(), bias))
            used.update(p[1] for p in parts)
        return used

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """(HF name, tensor) pairs; under tensor parallelism each tensor is already this rank's slice."""
        params = dict(self.named_parameters())
        covered: dict[str, int] = {}  # rows of each parameter loaded so far
        for name, w in weights:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if name == "lm_head.weight" and w.shape[0] < self.lm_head.weight.shape[0]:  # the last, padded slice
                w = torch.cat([w, w.new_zeros(self.lm_head.weight.shape[0] - w.shape[0], w.shape[1])])
            target, shard = self.fused_target(name)
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            p = params[target]
            with torch.no_grad():
                if shard is None:
                    p.copy_(w)
                else:
                    start, size = shard
                    _rows(p).narrow(0, start, size).copy_(w)
            covered[target] = covered.get(target, 0) + (shard[1] if shard is not None else _rows(p).shape[0])
        missing = {n for n, p in params.items() if covered.get(n, 0) < _rows(p).shape[0]}
        if self.tie_word_embeddings:
            missing.discard("lm_head.weight")
            if self.tp.size > 1:  # this rank's vocab rows of the (replicated) embedding
                rows = self.lm_head.weight.shape[0]
                part = self.embed_tokens.weight.detach()[self.tp.rank * rows : (self.tp.rank + 1) * rows]
                with torch.no_grad():
                    self.lm_head.weight.zero_()[: part.shape[0]].copy_(part)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]} ...")

    def fused_target(self, name: str) -> tuple[str, tuple[int, int] | None]:
        """(our parameter, (row offset, rows) or None) of an HF name; families extend it."""
        return _fused_target(name, self)


def sliding_windows(cfg, max_position: int) -> list[int | None]:
    """Each layer's sliding window (None: it attends to every key), read as transformers reads
    the config: the "sliding_attention" entries of layer_types (Qwen2, Gemma), else every layer
    when the config has a sliding_window (Mistral). A window of max_position keys or more never
    bites: None."""
    window = getattr(cfg, "sliding_window", None)
    if not window or window >= max_position or getattr(cfg, "use_sliding_window", True) is False:
        return [None] * cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return [window] * cfg.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in types]


def _fused_target(name: str, model: LlamaForCausalLM) -> tuple[str, tuple[int, int] | None]:
    """Map an HF name to (our parameter, (row offset, rows)) for fused projections."""
    if ".self_attn." in name:
        for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            if f".{proj}." in name:
                attn = model.layers[int(name.split(".")[1])].self_attn
                offsets = (0, attn.q_size, attn.q_size + attn.kv_size)
                sizes = (attn.q_size, attn.kv_size, attn.kv_size)
                return name.replace(proj, "qkv_proj"), (offsets[i], sizes[i])
    if ".mlp." in name:
        for i, proj in enumerate(("gate_proj", "up_proj")):
            if f".{proj}." in name:  # the MLP owning it: the layer's, or a MoE block's shared expert
                inter = model.get_submodule(name[: name.index(f".{proj}.")]).intermediate  # this rank's share
                return name.replace(proj, "gate_up_proj"), (i * inter, inter)
    return name, None


def _rows(p: torch.Tensor) -> torch.Tensor:
    """p as rows: its leading dims flattened (stacked experts [E, N, K] -> [E * N, K])."""
    return p.flatten(0, -2) if p.dim() > 2 else p
