"""hybridllm: run one LLM across a GPU and the host CPU, behind vLLM-shaped interfaces."""

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
