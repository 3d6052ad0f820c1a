"""Multi-LoRA serving: many PEFT adapters over one base model, mixed in one batch.

- config.py: LoRAConfig (vLLM's --enable-lora, --lora-modules, --max-loras, --max-lora-rank, --max-cpu-loras)
- request.py: LoRARequest, as vLLM's (name, int id, path)
- adapter.py: a PEFT adapter folder read, checked against the base model and laid out per fused linear
- registry.py: the engine's adapters by name: static and run-time ones, loaded copies kept LRU (--max-cpu-loras)
- layers.py: the step's adapter slots (--max-loras) beside the base linears, and the LoRA delta they add
"""

from tokenmill.lora.config import LoRAConfig
from tokenmill.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
