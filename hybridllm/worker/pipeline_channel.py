"""Stage-to-stage activations between worker processes on one node, over shared memory."""

from __future__ import annotations

from typing import Any

import torch

from hybridllm.config import EngineConfig
from hybridllm.distributed.message_queue import Handle, MessageQueue

_SLACK_BYTES = 64 << 10  # pickle stream and the codec's header around the arrays


def activation_chunk_bytes(config: EngineConfig) -> int:
    """Ring chunk size that holds one step's (hidden_states, residual) inline.

    A message larger than a chunk would fall back to the queue's ZeroMQ path (TCP on
    loopback), which is exactly what this channel exists to avoid for the step loop.
    """
    hidden = config.model_config.hf_config.hidden_size
    itemsize = getattr(torch, config.model_config.dtype).itemsize
    tokens = config.scheduler_config.max_num_batched_tokens
    return 2 * tokens * hidden * itemsize + _SLACK_BYTES


class PipelineSender:
    """The sending end of one pipeline edge: stage k's tp-rank-0 worker writes, every
    tensor-parallel rank of stage k+1 reads (they all need the full activations)."""

    def __init__(self, config: EngineConfig, num_receivers: int):
        # One chunk per micro-batch in flight, plus one so the sender never waits on a
        # receiver that is merely one step behind.
        max_chunks = config.plan.pipeline_parallel_size + 1
        self.queue = MessageQueue(
            num_receivers, max_chunk_bytes=activation_chunk_bytes(config), max_chunks=max_chunks
        )

    def export_handle(self) -> Handle:
        return self.queue.export_handle()

    def send(self, activations: Any) -> None:
        """Send IntermediateTensors (or a list of them); GPU tensors go through host memory."""
        self.queue.enqueue(activations)

    def close(self) -> None:
        self.queue.close()


class PipelineReceiver:
    """The receiving end of one pipeline edge."""

    def __init__(self, handle: Handle, tp_rank: int):
        self.queue = MessageQueue.attach(handle, tp_rank)

    def recv(self) -> Any:
        """The next activations, in send order (raises WriterDiedError if the sender died)."""
        return self.queue.dequeue()

    def close(self) -> None:
        self.queue.close()
