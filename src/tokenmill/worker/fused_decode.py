"""The fused decode step: small decode (and verification) batches run as one C++ call per step.

A decode step of a small batch is bound by reading the weights (batch 1 reads every weight once
per token). Run op by op it is ~300 kernel calls with Python between them, and the weight
stream stalls at each; csrc/decode_step.cpp runs the whole forward pass (embedding, layers,
final norm, LM head) in one parallel region with the same row and tile kernels, so its logits
equal the op-by-op model's bit for bit. This is the CPU's counterpart of capturing a decode
graph on a GPU: it changes how the step is run, not what it computes.

Used for steps of at most SMALL_BATCH rows (where the linears run the engine's own kernels
anyway) whose rows are all decode tokens, or, batch-invariant (the default), whose requests have
at most MAX_Q query rows each: decode tokens, speculative verification chunks (k + 1 causal rows
at positions start .. start + k, logits for each), short prompt chunks, in any mix. Such steps
take the varlen view of the metadata (query_start_loc, seq_lens, block_tables) and attend with the
rows kernel, each row exactly as the op-by-op model (and a lone decode step) computes it. On bf16
models whose linears are bf16 panels, int4 / int8 blocks or W8A8 (each thread quantizes a linear's
input rows itself, as the op does), with a bf16, int8 or fp8 KV cache (int8 / fp8: all-decode
steps only, since those caches are not batch-invariant).
TOKENMILL_FUSED_DECODE=0 turns it off. Under tensor parallelism each rank runs its shard this
way, with the all-reduces after o_proj and down_proj inside the step (the shared-memory
all-reduce, called from C++), and the vocab slices of the logits gathered on rank 0 after it.
Its threads wait for each other at a barrier that spins briefly and then sleeps
(TOKENMILL_SPIN_US), so that the step slows in proportion, rather than collapsing, when other
processes take cores (cpu_threads).
Multi-LoRA: after set_lora(specs) (the adapters' slot buffers, csrc/lora.h), a step given
row_slots adds each row's adapter to the adapted linears inside the step (lora_add's kernels).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenmill import envs
from tokenmill.distributed.comm import NO_TP, SPIN_NS, TPAborted, TPGroup
from tokenmill.kernels import cpu_kernels, cpu_threads
from tokenmill.model.layers.attention import AttentionBackend, AttentionMetadata
from tokenmill.model.layers.linear import SMALL_BATCH, PackedLinear
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.quantization import QuantEmbedding, QuantLinear
from tokenmill.model.layers.rotary import RotaryEmbedding
from tokenmill.model.layers.w8a8 import W8A8Linear
from tokenmill.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

if TYPE_CHECKING:
    from tokenmill.model.layers.gpu_attention import TritonAttentionBackend

logger = logging.getLogger("tokenmill")


W8A8_BITS = 88  # decode_step.cpp's kBitsW8A8: a W8A8Linear in the spec


def _linear_spec(layer: nn.Module) -> tuple[Any, ...] | None:
    """(weight, scales, bits, bias) as the C++ decoder takes it, or None if it cannot run it."""
    if isinstance(layer, PackedLinear) and layer.panels is not None:
        return layer.panels, None, 16, layer.bias
    if isinstance(layer, QuantLinear):
        bias = layer.bias.detach() if layer.bias is not None else None
        return layer.qweight, layer.scales, layer.bits, bias
    if isinstance(layer, W8A8Linear):  # its per-token activation quantization runs inside the step
        return layer.packed, layer.w_scale, W8A8_BITS, layer.bias
    return None


# What csrc/decode_step.cpp implements, module by module: Llama's decoder layer (its norms, attention
# and SwiGLU MLP, each exactly these classes: a subclass may compute something else), around it
# the model's embedding (unscaled), final norm and LM head. The linears are checked by _linear_spec.
_LAYER_PARTS = {
    "input_layernorm": RMSNorm,
    "self_attn": LlamaAttention,
    "post_attention_layernorm": RMSNorm,
    "mlp": LlamaMLP,
}
_ATTENTION_PARTS = ("qkv_proj", "o_proj")
_MLP_PARTS = ("gate_up_proj", "down_proj")


def unsupported_module(model: nn.Module) -> str | None:
    """The first module of `model` the fused step does not implement (its path and class), or None.
    Whether a family runs fused follows from what it is built of, not from its class."""
    cls = type(model)
    if not isinstance(model, LlamaForCausalLM) or any(
        getattr(cls, m) is not getattr(LlamaForCausalLM, m) for m in ("forward", "compute_logits")
    ):
        return f"the model ({cls.__name__}: its own forward)"
    if not isinstance(model.embed_tokens, (nn.Embedding, QuantEmbedding)):
        return f"embed_tokens ({type(model.embed_tokens).__name__})"
    if type(model.norm) is not RMSNorm:
        return f"norm ({type(model.norm).__name__})"
    if type(model.rope) is not RotaryEmbedding:
        return f"rope ({type(model.rope).__name__})"
    if not model.rope.fusable:
        return "rope (RotaryEmbedding turning part of each head: the step turns whole heads)"
    for i, layer in enumerate(model.layers):
        if type(layer).forward is not LlamaDecoderLayer.forward:
            return f"layers.{i} ({type(layer).__name__})"
        children = dict(layer.named_children())
        for name, child in children.items():
            if _LAYER_PARTS.get(name) is not type(child):
                return f"layers.{i}.{name} ({type(child).__name__})"
        for block, parts in (("self_attn", _ATTENTION_PARTS), ("mlp", _MLP_PARTS)):
            extra = [n for n in dict(children[block].named_children()) if n not in parts]
            if extra:
                return f"layers.{i}.{block}.{extra[0]}"
    return None


# The most query rows one request may have in a fused step (and at most SMALL_BATCH rows in all):
# a decode token is 1, a speculative verification k + 1.
MAX_Q = 16


class FusedDecode:
    def __init__(
        self,
        decoder: Any,
        tp: TPGroup = NO_TP,
        vocab_size: int = 0,
        batch_invariant: bool = False,
        decode_by_rows: bool = False,
    ) -> None:
        self.decoder, self.tp, self.vocab_size = decoder, tp, vocab_size
        # Batch-invariant (as the attention backend is): every step's attention through the rows
        # kernel, so multi-row chunks run here too, each row as the op-by-op model computes it.
        self.batch_invariant = batch_invariant
        # decode steps through the rows kernel too (the backend's choice for int8 / fp8 caches)
        self.decode_by_rows = batch_invariant or decode_by_rows

    @classmethod
    def build(
        cls,
        model: Any,
        attn: AttentionBackend | TritonAttentionBackend,
        dtype: torch.dtype,
        block_size: int,
        tp: TPGroup = NO_TP,
    ) -> FusedDecode | None:
        """The fused step for this model (this rank's shard), or None (logged) when it cannot run it."""
        if not envs.TOKENMILL_FUSED_DECODE:
            return None
        kernels = cpu_kernels.load() if cpu_kernels.enabled() else None
        reason = None
        unsupported = unsupported_module(model)
        if unsupported is not None:
            logger.debug("fused decode step off: it does not implement %s", unsupported)
            return None
        if kernels is None or not hasattr(kernels, "FusedDecoder"):
            reason = "needs the C++ kernels built with AVX512-BF16 or AVX2 + FMA"
        elif dtype != torch.bfloat16 or attn.kernels is None:
            reason = "needs bfloat16 activations"
        elif not attn.plain:
            reason = "sliding-window or soft-capped attention"
        elif tp.size > 1 and (tp.shm is None or tp.shm.kernel is None):
            reason = "tensor parallel without the shared-memory all-reduce kernel"
        if reason is None:
            layers = model.layers
            parts = [
                p
                for layer in layers
                for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            ]
            specs = [_linear_spec(p) for p in parts + [model.lm_head]]
            if any(s is None for s in specs):
                reason = "needs every linear as bf16 panels, int4 / int8 blocks or W8A8"
        if reason is not None:
            logger.info("fused decode step off: %s", reason)
            return None
        assert kernels is not None  # reason None
        embed = model.embed_tokens
        table: tuple[torch.Tensor, torch.Tensor | None, int]
        if isinstance(embed, QuantEmbedding):
            table = (embed.qweight, embed.scales, embed.bits)
        else:
            table = (embed.weight.detach(), None, 16)
        norms = [n.weight.detach() for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        norms.append(model.norm.weight.detach())
        caches = [c for pair in attn.layer_caches for c in pair]
        # int8 / fp8 caches: each layer's K and V scales ([slots, kv_heads] float32) beside them
        scales = (
            [] if attn.kv_scales is None else [attn.kv_scales[layer, i] for layer in range(len(layers)) for i in (0, 1)]
        )
        a0 = layers[0].self_attn
        try:
            decoder = kernels.FusedDecoder(
                *table,
                norms,
                specs,
                caches,
                model.rope.cos,
                model.rope.sin,
                a0.num_heads,
                a0.num_kv_heads,
                a0.head_dim,
                layers[0].mlp.intermediate,
                model.lm_head.out_features,
                model.norm.eps,
                block_size,
                attn.scale,
                scales,
            )
        except RuntimeError as e:  # a shape or dtype the C++ decoder does not take
            logger.info("fused decode step off: %s", e)
            return None
        decoder.spin_ns = cpu_threads.barrier_spin_ns()  # spin, then sleep: see cpu_threads
        if tp.size > 1:
            assert tp.shm is not None  # reason None
            decoder.set_tensor_parallel(tp.shm.slots, tp.shm.words_t, tp.rank, tp.size, SPIN_NS)
        invariant = bool(getattr(attn, "batch_invariant", False))
        if invariant:
            logger.info("fused decode step on for steps of <= %d rows, <= %d per request", SMALL_BATCH, MAX_Q)
        else:
            logger.info("fused decode step on for all-decode batches of <= %d rows", SMALL_BATCH)
        return cls(decoder, tp, model.cfg.vocab_size, invariant, bool(getattr(attn, "decode_by_rows", False)))

    def accepts(self, meta: AttentionMetadata, rows: int) -> bool:
        """Whether this step can run here: at most SMALL_BATCH rows, and either all decode rows or
        (batch-invariant) requests of at most MAX_Q query rows each: decode tokens, speculative
        verification chunks, short prompt chunks, mixed."""
        if rows > SMALL_BATCH:
            return False
        if meta.all_decode:
            return True
        return self.batch_invariant and meta.query_start_loc is not None and meta.max_query_len <= MAX_Q

    def set_lora(self, specs: list[Any]) -> None:
        """Multi-LoRA slot buffers: 4 entries per layer (qkv, o, gate_up, down), each (A, Bt, ranks,
        slice_bounds) as lora_add takes them, or None; kept and read at every step."""
        self.decoder.set_lora(specs)

    def clear_lora(self) -> None:
        self.decoder.clear_lora()

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_rows: torch.Tensor,
        row_slots: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Runs the step (K/V written, as the model would); float32 logits of `logits_rows` (any
        rows of the step: a verification wants each of its request's rows; on rank 0, None on the others). row_slots: int32 [rows],
        each row's LoRA slot (-1: the base model), after set_lora."""
        rows = torch.as_tensor(logits_rows, dtype=torch.long)
        args: tuple[torch.Tensor | None, ...]
        if self.decode_by_rows or not meta.all_decode:  # the rows kernel, over the varlen view
            args = (
                input_ids,
                positions,
                meta.slot_mapping,
                meta.block_tables,
                meta.seq_lens,
                rows,
                meta.query_start_loc,
            )
        else:  # decode rows, split over the threads at small batches
            args = (input_ids, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens, rows)
        if self.tp.size == 1:
            out: torch.Tensor = self.decoder.forward(*args, row_slots=row_slots)
            return out
        shm = self.tp.shm
        assert shm is not None  # checked by build
        self.decoder.tp_seq = shm.seq  # the step's all-reduces continue the Python side's sequence
        try:
            logits = self.decoder.forward(*args, row_slots=row_slots)
        except RuntimeError as e:
            raise TPAborted(str(e)) from e
        finally:
            shm.seq = self.decoder.tp_seq
        logits = self.tp.gather_to_first(logits)
        return logits[:, : self.vocab_size] if logits is not None else None
