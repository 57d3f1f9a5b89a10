"""Sampling: per-step metadata, the sampler, and logprobs of sampled and prompt tokens."""

from hybridllm.sample.logprobs import LogprobsTensors, compute_prompt_logprobs, gather_logprobs
from hybridllm.sample.sampler import Sampler, SamplerOutput
from hybridllm.sample.sampling_metadata import SamplingMetadata

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_prompt_logprobs",
    "gather_logprobs",
]
