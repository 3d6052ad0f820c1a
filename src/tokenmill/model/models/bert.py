"""BERT encoder (Hugging Face `BertModel`, e.g. all-MiniLM-L6-v2) over a flat token batch.

An encoder attends both ways inside each sequence, so a sequence runs whole in one pass and
keeps no K/V: the model never touches the paged cache (`IS_ENCODER`; the runner allocates none).
Every linear runs over the flat batch of the step's real tokens, no padding; only the attention
scores are computed per sequence, padded to the step's longest sequence with a key mask (their
cost is a few percent of the linears' at sentence lengths). Post-LayerNorm, as BERT is: each
sub-layer's output is added to its input and normalised. Q/K/V are fused into one matmul.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.comm import NO_TP, TPGroup
from tokenmill.model.layers.attention import AttentionMetadata
from tokenmill.model.layers.embedding import embedding

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class SequenceLayout:
    """Where each sequence of a flat batch sits in a [B, L] padded view (L: the longest), made
    once per step and used by every layer's attention."""

    def __init__(self, meta: AttentionMetadata, num_rows: int, device: torch.device):
        starts = meta.query_start_loc.cpu()
        lens = starts[1:] - starts[:-1]
        self.batch, self.max_len = len(lens), int(lens.max())
        self.dense = bool((lens == self.max_len).all())  # no padding at all (e.g. one sequence)
        if self.dense:
            return
        L = self.max_len
        pos = torch.arange(L)
        valid = pos.unsqueeze(0) < lens.unsqueeze(1)  # [B, L]
        # Padded slot (b, l) reads row start_b + l; a pad slot reads the sequence's last row instead
        # of zeros (its key is masked, its query's output dropped), so one gather fills the view.
        self.gather = (starts[:-1].unsqueeze(1) + torch.minimum(pos.unsqueeze(0), lens.unsqueeze(1) - 1)).flatten()
        self.scatter = valid.flatten().nonzero().squeeze(1)  # the padded slots of the flat rows, in order
        self.gather, self.scatter = self.gather.to(device), self.scatter.to(device)
        self.key_mask = valid.view(self.batch, 1, 1, L).to(device)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // self.num_heads
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        T, hidden = x.shape
        H, D, B, L = self.num_heads, self.head_dim, layout.batch, layout.max_len
        qkv = self.qkv_proj(x)
        mask = None
        if not layout.dense:
            qkv, mask = qkv.index_select(0, layout.gather), layout.key_mask
        q, k, v = qkv.view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)  # each [B, H, L, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B * L, hidden)
        if not layout.dense:
            out = out.index_select(0, layout.scatter)
        return self.norm(self.o_proj(out) + x)


class BertFeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        act = getattr(cfg, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"BERT hidden_act {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[act]
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down_proj(self.act(self.up_proj(x))) + x)


class BertLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention = BertSelfAttention(cfg)
        self.mlp = BertFeedForward(cfg)

    def forward(self, x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        return self.mlp(self.attention(x, layout))


class BertModel(nn.Module):
    ARCHITECTURES = {"BertModel": False}
    IS_ENCODER = True  # bidirectional, whole sequences per pass, no KV cache; only pooling (embeddings)
    PACK_FLOAT32_LINEARS = True  # float32 linears run on oneDNN's GEMM too (layers/linear.py)

    def __init__(self, cfg, dtype: torch.dtype, max_position: int, tp: TPGroup = NO_TP):
        super().__init__()
        if getattr(cfg, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"BERT position_embedding_type {cfg.position_embedding_type!r} is not supported (only absolute)"
            )
        self.cfg = cfg
        self.tie_word_embeddings = False
        self.word_embeddings = embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.embed_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        # Not called `layers`: that name means decoder layers to the decode-step code (weight arena).
        self.blocks = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [T, hidden] of whole sequences (`attn`, the paged backend, is unused)."""
        layout = SequenceLayout(meta, input_ids.shape[0], input_ids.device)
        # Single-segment inputs: token type 0 for every token (what sentence-transformers feeds).
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        x = self.embed_norm(x)
        for block in self.blocks:
            x = block(x, layout)
        return x

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """What pooling reads: the forward's output is already the last layer's normalised states."""
        return hidden

    # ---- weights ---------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, w in weights:
            target, rows = _target(name, self.cfg.hidden_size)
            if target is None:
                continue
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            with torch.no_grad():
                p = params[target]
                (p if rows is None else p.narrow(0, rows[0], rows[1])).copy_(w)
            loaded.add(f"{target}:{rows}")
        missing = sorted(n for n in params if not any(key.startswith(n + ":") for key in loaded))
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]} ...")


_RENAMES = (  # Hugging Face BertModel names -> ours (checked in order)
    ("embeddings.LayerNorm.", "embed_norm."),
    ("embeddings.", ""),
    ("attention.output.dense.", "attention.o_proj."),
    ("attention.output.LayerNorm.", "attention.norm."),
    ("intermediate.dense.", "mlp.up_proj."),
    ("output.dense.", "mlp.down_proj."),
    ("output.LayerNorm.", "mlp.norm."),
)


def _target(name: str, hidden: int) -> tuple[str | None, tuple[int, int] | None]:
    """Our parameter for an HF tensor name and, for the fused Q/K/V, its rows; None: not used
    (the classification pooler, position id buffers)."""
    name = name.removeprefix("bert.").replace(".gamma", ".weight").replace(".beta", ".bias")  # old TF names
    if name.startswith("pooler.") or name.endswith("position_ids") or name.startswith(("cls.", "lm_head.")):
        return None, None
    name = name.replace("encoder.layer.", "blocks.")
    for i, proj in enumerate(("query", "key", "value")):
        part = f"attention.self.{proj}."
        if part in name:
            return name.replace(part, "attention.qkv_proj."), (i * hidden, hidden)
    for old, new in _RENAMES:
        if old in name:
            return name.replace(old, new, 1), None
    return name, None
