"""Megatron-style shards of a Llama-family checkpoint, by Hugging Face tensor name.

Column-parallel (each rank keeps a slice of the output rows): q/k/v by whole heads, gate and up,
the LM head (vocab rows, padded to equal slices). Row-parallel (a slice of the input columns,
then an all-reduce): o_proj and down_proj; their bias is added once, by rank 0. Replicated:
norms and the token embedding (its 50-100 MB lookup costs no compute, and replicating it spares
a collective per step).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.model.layers.quantization import GROUP


@dataclass(frozen=True)
class Shard:
    dim: int  # the dimension sliced
    start: int
    size: int  # rows / columns this rank reads (the LM head's last slice may be short)
    zero: bool = False  # a row-parallel bias on ranks > 0


def valid_tp_sizes(hf_config) -> list[int]:
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    inter = hf_config.intermediate_size
    return [n for n in range(1, heads + 1) if heads % n == 0 and kv % n == 0 and inter % n == 0]


def check_tp_size(hf_config, size: int, quantization: str | None) -> None:
    """Refuses a size the model cannot be split into, naming the sizes that work."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    ok = valid_tp_sizes(hf_config)
    if size not in ok:
        heads = hf_config.num_attention_heads
        kv = getattr(hf_config, "num_key_value_heads", None) or heads
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the model's {heads} attention heads, {kv} kv heads and "
            f"intermediate size {hf_config.intermediate_size}; sizes that work: {', '.join(map(str, ok))}")
    if quantization == "gguf":
        raise ValueError("--quantization gguf keeps a GGUF file's blocks whole and cannot be split across ranks; "
                         "with --tensor-parallel-size use --quantization int4 or int8 (each rank quantizes its "
                         "own shard) or no quantization")
    if quantization == "w8a8":  # one set of smoothing factors per norm, computed from every rank's rows
        raise ValueError("--quantization w8a8 is not supported with --tensor-parallel-size > 1 yet")
    if quantization in ("int4", "int8"):
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        for what, cols in (("o_proj", hf_config.num_attention_heads * head_dim),
                           ("down_proj", hf_config.intermediate_size)):
            if (cols // size) % GROUP:
                raise ValueError(f"--quantization {quantization} quantizes in groups of {GROUP} input columns, and "
                                 f"{what}'s {cols} columns split {size} ways are {cols // size} per rank, not a "
                                 f"multiple of {GROUP}; use another --tensor-parallel-size or no quantization")


def shard_for(name: str, hf_config, rank: int, size: int) -> Shard | None:
    """The slice of checkpoint tensor `name` that `rank` of `size` reads; None: all of it."""
    if size == 1:
        return None
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    inter = hf_config.intermediate_size

    def rows(total: int) -> Shard:
        n = total // size
        return Shard(0, rank * n, n)

    if ".q_proj." in name:
        return rows(heads * head_dim)
    if ".k_proj." in name or ".v_proj." in name:
        return rows(kv * head_dim)
    if ".gate_proj." in name or ".up_proj." in name:
        return rows(inter)
    for proj, cols in ((".o_proj.", heads * head_dim), (".down_proj.", inter)):
        if proj in name:
            if name.endswith(".bias"):
                return None if rank == 0 else Shard(0, 0, 0, zero=True)
            n = cols // size
            return Shard(1, rank * n, n)
    if name.endswith("lm_head.weight"):
        per = lm_head_rows(hf_config.vocab_size, size)
        start = rank * per
        return Shard(0, start, max(0, min(per, hf_config.vocab_size - start)))
    return None


def lm_head_rows(vocab: int, size: int) -> int:
    """Vocab rows per rank: equal slices, the last one padded."""
    return -(-vocab // size)
