"""hybridllm: run one LLM across a GPU and the host CPU, behind vLLM-shaped interfaces."""

import os

# torch's CPU allocator asks for transparent huge pages for its buffers of 2 MB and more when
# this is set before torch loads (read at its first allocation; worker processes inherit it).
# With it, and the worker keeping freed memory (worker/host_allocator.py), a 16 x 128-token MoE
# prefill took 4.7 s against 7.6 s (2-core KVM guest). THP_MEM_ALLOC_ENABLE=0 turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from hybridllm.outputs import CompletionOutput, Logprob, RequestOutput
from hybridllm.sampling_params import SamplingParams
from hybridllm.structured.params import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str):
    # `LLM` pulls in torch and the model code: import it only when asked for.
    if name == "LLM":
        from hybridllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'hybridllm' has no attribute {name!r}")
