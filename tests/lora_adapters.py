"""PEFT LoRA adapters made in the tests: random non-zero A and B on a base model folder."""

from __future__ import annotations

from pathlib import Path

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: str,
    out: Path,
    rank: int = 8,
    targets=None,
    seed: int = 0,
    alpha: int | None = None,
    std: float = 0.05,
    **config,
) -> str:
    """Saves a PEFT adapter for base_dir (random A and B of this std, so it changes the output) and
    returns its folder. `config`: more LoraConfig fields (use_rslora, rank_pattern, ...)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=targets or ALL,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        **config,
    )
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    return str(out)


def peft_model(base_dir: str, adapter_dir: str):
    """transformers + peft with the adapter applied (float32, eval): the oracle."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()
