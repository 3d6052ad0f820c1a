"""Engine configuration: plain dataclasses, named like vLLM's engine arguments."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from tokenmill.lora.config import LoRAConfig
    from tokenmill.model.pooling import PoolerConfig
    from tokenmill.spec_decode.config import SpeculativeConfig


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


# The --dtype names each device runs (aliases above map onto them); float16 has no fast CPU kernels.
DTYPE_CHOICES = {"cpu": ("float32", "bfloat16"), "cuda": ("float32", "bfloat16", "float16")}

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")
# Caches stored with one float32 scale per (slot, kv head); vLLM's "fp8" is e4m3 on CPUs and NVIDIA GPUs.
SCALED_KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return kv_cache_dtype


def resolve_device(device: str) -> str:
    """auto -> cuda when a GPU is visible, else cpu (vLLM's default)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"unknown device {device!r}; choose one of auto, cpu, cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: no CUDA GPU is visible to torch {torch.__version__} "
            f"(a CPU build, or no driver); use --device cpu"
        )
    return device


LOAD_FORMATS = ("auto", "dummy")
SCHEDULING_POLICIES = ("fcfs", "priority")


def parse_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """'auto' picks bfloat16: on AMX CPUs and on GPUs it is the faster choice for batched serving
    (measured: benchmarks/throughput.py); float16 is refused on CPU (slow, no real kernels)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, float32, bfloat16, float16")
    if device == "cpu" and _DTYPES[dtype] not in {_DTYPES[d] for d in DTYPE_CHOICES["cpu"]}:
        raise ValueError("float16 runs on GPUs only (no fast CPU kernels); use bfloat16 or float32 on the CPU")
    return _DTYPES[dtype]


# A server's default --itl-target-ms: streams keep flowing while long prompts are prefilled. Offline
# (LLM.generate, bench) nothing streams beside a batch, and steps take the whole token budget.
DEFAULT_SERVING_ITL_TARGET_MS = 250.0


@dataclass(frozen=True)
class WatermarkConfig:
    gamma: float = 0.5  # fraction of the vocabulary that is green at each step
    delta: float = 2.0  # logit bonus of green tokens

    def __post_init__(self) -> None:
        if not 0.0 < self.gamma < 1.0:
            raise ValueError(f"watermark gamma must be in (0, 1), got {self.gamma}")
        if self.delta <= 0.0:
            raise ValueError(f"watermark delta must be positive, got {self.delta}")


@dataclass
class EngineArgs:
    """Everything needed to build an engine. CLI flags map 1:1 onto these fields."""

    model: str | None = None  # HF folder, .gguf file, or None for the built-in default model
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"  # auto (cuda when available, else cpu) | cpu | cuda
    max_model_len: int | None = None  # default: the model's context length (capped, see below)
    block_size: int = 16
    kv_cache_memory: float | None = None  # GiB for the KV pool; default: enough for the load
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | int8 | fp8 / fp8_e4m3 (per-token, per-head scales)
    # int4 | int8 (weight-only, groups of 32) | gguf (keep a GGUF's blocks) | w8a8 | fp8 (quantized here) | awq | gptq |
    # compressed-tensors | fp8 (a checkpoint's own: detected from its quantization_config without the flag; the flag
    # checks the format)
    quantization: str | None = None
    quantization_calibration: str | None = None  # w8a8: the smoothing's calibration file (default: the packaged set)
    num_gpu_blocks_override: int | None = None  # exact number of KV blocks (tests)
    gpu_memory_utilization: float = 0.9  # cuda: fraction of the GPU's memory this engine may use
    enforce_eager: bool = False  # cuda: no CUDA graphs
    load_format: str = "auto"  # auto (the checkpoint) | dummy (random weights: benchmarks without the files)
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: max(2048, max_model_len) capped
    scheduling_policy: str = "fcfs"  # fcfs | priority (requests' priority: lower first, ties by arrival)
    enable_chunked_prefill: bool = True
    # while requests decode, a step's prompt tokens keep it this long (engine/step_budget.py; 0: off); None:
    # DEFAULT_SERVING_ITL_TARGET_MS in a server (AsyncLLMEngine), 0 offline (LLM: throughput first)
    itl_target_ms: float | None = None
    enable_prefix_caching: bool = True
    watermark_gamma: float = 0.5  # green fraction of the vocabulary for requests with watermark on
    watermark_delta: float = 2.0  # logit bonus of green tokens
    seed: int = 0
    num_threads: int | None = None  # per tensor-parallel rank
    tensor_parallel_size: int = 1  # ranks the model is split across (one process each beyond the engine's)
    served_model_name: str | None = None
    # auto (an encoder embeds, a decoder generates) | generate | embed (a decoder as an embedder, vLLM's --task embed)
    task: str = "auto"
    override_pooler_config: str | dict | None = None  # vLLM's JSON: {"pooling_type": "MEAN", "normalize": true}
    # vLLM's JSON: {"method": "ngram" | "suffix" | "draft_model", "num_speculative_tokens": k, ...}
    speculative_config: str | dict | None = None
    # Multi-LoRA, vLLM's flags: adapters by name (`name=path` or JSON {"name", "path", "base_model_name"})
    enable_lora: bool = False
    lora_modules: list | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    allow_runtime_lora_updating: bool = False  # the server's /v1/load_lora_adapter and /v1/unload_lora_adapter
    lora_path_allowlist: list | None = None  # folders adapters may be read from (None: anywhere)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


@dataclass
class ModelConfig:
    path: str  # resolved HF-style folder
    hf_config: PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    name: str
    device: str = "cpu"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    load_format: str = "auto"
    pooler: PoolerConfig | None = None  # the engine runs embeddings (--task embed)
    quantization_calibration: str | None = None  # w8a8's calibration file (None: the packaged set)
    aliases: tuple[str, ...] = ()  # other names requests may give for `name` (a GGUF file's path)

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def kv_scaled_dtype(self) -> torch.dtype | None:
        """The cache's element type when it is int8 / float8 with per-(slot, kv head) scales, else None."""
        return SCALED_KV_DTYPES.get(self.kv_cache_dtype)

    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers; int8 / fp8 add a float32 scale per kv head."""
        if self.kv_scaled_dtype is not None:
            per_head = self.head_dim + 4
        else:
            per_head = self.head_dim * torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * per_head


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 0  # decided at start-up from the memory budget
    enable_prefix_caching: bool = True


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    max_loras: int = 0  # distinct LoRA adapters one step may hold (0: LoRA off)
    policy: str = "fcfs"  # fcfs | priority (see scheduler.py)
    # while requests decode, a step's prompt tokens keep it within this inter-token latency (engine/
    # step_budget.py); 0: every step takes the whole token budget
    itl_target_ms: float = 0.0


@dataclass
class DeviceConfig:
    """GPU-only settings (ignored on the CPU)."""

    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    num_threads: int | None = None  # per rank; default: the available cores shared out


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    seed: int = 0
    watermark: WatermarkConfig = field(default_factory=WatermarkConfig)
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None
    extra: dict = field(default_factory=dict)
