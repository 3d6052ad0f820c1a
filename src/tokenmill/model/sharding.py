"""Megatron-style shards of a Llama-family checkpoint, by Hugging Face tensor name.

Column-parallel (each rank keeps a slice of the output rows): q/k/v by whole heads, gate and up,
the LM head (vocab rows, padded to equal slices). Row-parallel (a slice of the input columns,
then an all-reduce): o_proj and down_proj; their bias is added once, by rank 0. Replicated:
norms and the token embedding (its 50-100 MB lookup costs no compute, and replicating it spares
a collective per step).

Which models split follows from their modules: each module type that splits (or is replicated)
has a rule here (`sharding_rule`, registered beside the class for the model's own blocks), and a
model runs under tensor parallelism only when every module in it is covered, by a rule of its
own or by its parent's (check_shardable, before the model loads). A subclass keeps its parent
class's rule while it keeps the methods the rule relies on (forward: where the all-reduce is).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.quantization import GROUP
from tokenmill.model.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class ShardingRule:
    how: str  # what each rank holds and which collective follows
    covers: tuple[str, ...] = ()  # children this rule splits (their own rules are not asked)
    methods: tuple[str, ...] = ("forward",)  # what a subclass must keep to keep the rule


_RULES: dict[type, ShardingRule] = {}


def sharding_rule(how: str, covers: tuple[str, ...] = (), methods: tuple[str, ...] = ("forward",)):
    """Class decorator: instances split across tensor-parallel ranks as `how` says, children named
    in `covers` with them (the class's forward does the collectives `how` needs)."""

    def register(cls: type) -> type:
        _RULES[cls] = ShardingRule(how, covers, methods)
        return cls

    return register


for _cls, _how in (
    (RMSNorm, "replicated (a per-head norm: each rank normalizes its own heads)"),
    (nn.Embedding, "replicated"),
    (RotaryEmbedding, "replicated"),
    (nn.ModuleList, "a container"),
    (nn.ModuleDict, "a container"),
):
    sharding_rule(_how)(_cls)


def rule_for(module: nn.Module) -> ShardingRule | None:
    """The rule of the module's class, or of the nearest base class whose rule's methods it keeps."""
    cls = type(module)
    for base in cls.__mro__:
        rule = _RULES.get(base)
        if rule is not None:
            if all(getattr(cls, m, None) is getattr(base, m, None) for m in rule.methods):
                return rule
            return None  # it overrides what the rule relies on: a rule of its own is needed
    return None


def unshardable_module(module: nn.Module, name: str = "") -> str | None:
    """The first module (its path and class) that no sharding rule covers, or None."""
    rule = rule_for(module)
    if rule is None:
        return f"{name or 'the model'} ({type(module).__name__})"
    for child_name, child in module.named_children():
        if child_name not in rule.covers:
            what = unshardable_module(child, f"{name}.{child_name}" if name else child_name)
            if what is not None:
                return what
    return None


def check_shardable(model: nn.Module, size: int) -> None:
    """Refuses tensor parallelism for a model with a module no sharding rule covers, naming it."""
    if size > 1 and (what := unshardable_module(model)) is not None:
        raise ValueError(
            f"--tensor-parallel-size > 1 is not supported for {type(model).__name__} yet: "
            f"{what} has no sharding rule (model/sharding.py)"
        )


@dataclass(frozen=True)
class Shard:
    dim: int  # the dimension sliced
    start: int
    size: int  # rows / columns this rank reads (the LM head's last slice may be short)
    zero: bool = False  # a row-parallel bias on ranks > 0


def _intermediate_sizes(hf_config) -> dict[str, int]:
    """Each split intermediate dimension: the MLP's, a mixture's experts' and shared expert's."""
    sizes = {"intermediate size": hf_config.intermediate_size}
    if getattr(hf_config, "moe_intermediate_size", None):
        sizes["experts' intermediate size"] = hf_config.moe_intermediate_size
    if getattr(hf_config, "shared_expert_intermediate_size", None):
        sizes["shared expert's intermediate size"] = hf_config.shared_expert_intermediate_size
    return sizes


def _intermediate_of(name: str, hf_config) -> int:
    """The intermediate size a checkpoint tensor's rows or columns span."""
    if ".shared_expert." in name:
        return hf_config.shared_expert_intermediate_size
    if ".experts." in name:
        return getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    return hf_config.intermediate_size


def valid_tp_sizes(hf_config) -> list[int]:
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    inters = _intermediate_sizes(hf_config).values()
    return [n for n in range(1, heads + 1) if heads % n == 0 and kv % n == 0 and all(i % n == 0 for i in inters)]


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
        inters = ", ".join(f"{what} {n}" for what, n in _intermediate_sizes(hf_config).items())
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the model's {heads} attention heads, {kv} kv heads and "
            f"{inters}; sizes that work: {', '.join(map(str, ok))}"
        )
    if quantization == "gguf":
        raise ValueError(
            "--quantization gguf keeps a GGUF file's blocks whole and cannot be split across ranks; "
            "with --tensor-parallel-size use --quantization int4 or int8 (each rank quantizes its "
            "own shard) or no quantization"
        )
    if quantization == "w8a8":  # one set of smoothing factors per norm, computed from every rank's rows
        raise ValueError("--quantization w8a8 is not supported with --tensor-parallel-size > 1 yet")
    if quantization in ("int4", "int8"):
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        shared = getattr(hf_config, "shared_expert_intermediate_size", None)
        for what, cols in (
            ("o_proj", hf_config.num_attention_heads * head_dim),
            ("down_proj", hf_config.intermediate_size),
            *((("the shared expert's down_proj", shared),) if shared else ()),
        ):
            if (cols // size) % GROUP:
                raise ValueError(
                    f"--quantization {quantization} quantizes in groups of {GROUP} input columns, and "
                    f"{what}'s {cols} columns split {size} ways are {cols // size} per rank, not a "
                    f"multiple of {GROUP}; use another --tensor-parallel-size or no quantization"
                )


def shard_for(name: str, hf_config, rank: int, size: int) -> Shard | None:
    """The slice of checkpoint tensor `name` that `rank` of `size` reads; None: all of it."""
    if size == 1:
        return None
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    inter = _intermediate_of(name, hf_config)
    if ".experts.gate_up_proj" in name or ".experts.down_proj" in name:  # transformers >= 5's stacked experts
        raise ValueError(
            f"{name}: experts stacked in one tensor cannot be split across ranks yet (per-expert tensors can)"
        )

    def rows(total: int) -> Shard:
        n = total // size
        return Shard(0, rank * n, n)

    if ".q_proj." in name:
        return rows(heads * head_dim)
    if ".k_proj." in name or ".v_proj." in name:
        return rows(kv * head_dim)
    if ".gate_proj." in name or ".up_proj." in name or ".experts." in name and (".w1." in name or ".w3." in name):
        return rows(inter)
    down = ".w2." if ".experts." in name and ".w2." in name else ".down_proj."  # Mixtral's experts: w1 / w3 / w2
    for proj, cols in ((".o_proj.", heads * head_dim), (down, inter)):
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
