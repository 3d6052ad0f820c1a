"""tokenmill: a high-throughput LLM inference and serving engine."""

from tokenmill.kernels.cpu_threads import openmp_wait_defaults

with openmp_wait_defaults():  # libgomp reads its wait policy once, as torch loads it (cpu_threads)
    import torch  # noqa: F401

from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.llm import LLM
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "LoRARequest",
    "AsyncLLMEngine",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineArgs",
    "__version__",
]
