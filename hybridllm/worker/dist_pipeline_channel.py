"""Stage-to-stage activations between nodes, over torch.distributed (NCCL between GPUs, else gloo)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridllm.distributed.message_queue import ReaderDiedError, WriterDiedError
from hybridllm.plan.plan import Plan
from hybridllm.worker.intermediate_tensors import IntermediateTensors

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HEADER = 8  # is_list, n_items, total_tokens, hidden, dtype, has_residual, (spare x2)


@dataclass(frozen=True)
class EdgeGroup:
    """The process group of one pipeline edge that crosses nodes: the sending stage's
    tp-rank-0 worker (`src`) and every tensor-parallel rank of the next stage."""

    pp_rank: int  # the sending stage
    src: int  # global rank of the sender
    ranks: tuple[int, ...]
    group: Any  # dist.ProcessGroup (or GroupMember.NON_GROUP_MEMBER outside it)
    nccl: bool  # every member is a GPU worker: the tensors stay on the device


def create_edge_groups(plan: Plan, timeout_s: float = 600.0) -> dict[int, EdgeGroup]:
    """One group per edge between stages on different nodes, keyed by the sending stage.

    Collective: every worker of the world calls it, in the same order, after joining.
    """
    from datetime import timedelta

    edges = {}
    for stage, nxt in zip(plan.stages, plan.stages[1:]):
        if stage.node == nxt.node:
            continue  # same node: the shared-memory channel
        src = stage.workers[0]
        ranks = (src.rank, *(w.rank for w in nxt.workers))
        nccl = not src.is_cpu and all(not w.is_cpu for w in nxt.workers)
        group = dist.new_group(
            list(ranks), timeout=timedelta(seconds=timeout_s), backend="nccl" if nccl else "gloo"
        )
        edges[stage.pp_rank] = EdgeGroup(stage.pp_rank, src.rank, ranks, group, nccl)
    return edges


class DistPipelineSender:
    """The sending end: a fixed header, then [parts, tokens, hidden] in one broadcast.

    Sends are asynchronous: the next send (or close) waits for the previous one, so a stage
    hands off a step and computes the next one while the bytes cross the network.
    """

    def __init__(self, edge: EdgeGroup, device: torch.device):
        self.edge = edge
        self.device = device if edge.nccl else torch.device("cpu")
        self._in_flight: list[tuple[Any, torch.Tensor]] = []

    def send(self, activations: IntermediateTensors | list[IntermediateTensors]) -> None:
        self._wait()
        is_list = isinstance(activations, list)
        items = activations if is_list else [activations]
        items = [a.to(self.device) for a in items]
        first = items[0]
        has_residual = first.residual is not None
        tokens = [a.num_tokens for a in items]
        header = torch.tensor(
            [
                is_list,
                len(items),
                sum(tokens),
                first.hidden_states.shape[-1],
                _DTYPES.index(first.hidden_states.dtype),
                has_residual,
                0,
                0,
            ],
            dtype=torch.int64,
            device=self.device,
        )
        parts = [torch.cat([a.hidden_states for a in items])]
        if has_residual:
            parts.append(torch.cat([a.residual for a in items]))
        data = torch.stack(parts)  # [parts, tokens, hidden]
        tensors = [header]
        if is_list:
            tensors.append(torch.tensor(tokens, dtype=torch.int64, device=self.device))
        tensors.append(data)
        for t in tensors:
            try:
                work = dist.broadcast(t, self.edge.src, group=self.edge.group, async_op=True)
            except RuntimeError as e:
                raise ReaderDiedError(f"pipeline edge to ranks {self.edge.ranks[1:]}: {e}") from e
            self._in_flight.append((work, t))  # the tensor must live until its send is done

    def _wait(self) -> None:
        try:
            for work, _ in self._in_flight:
                work.wait()
        except RuntimeError as e:  # gloo/NCCL: the connection to a receiver broke
            raise ReaderDiedError(f"pipeline edge to ranks {self.edge.ranks[1:]}: {e}") from e
        finally:
            self._in_flight.clear()

    def close(self) -> None:
        self._in_flight.clear()  # a peer may be gone: never block on close


class DistPipelineReceiver:
    """The receiving end, on every tensor-parallel rank of the next stage."""

    def __init__(self, edge: EdgeGroup, device: torch.device):
        self.edge = edge
        self.device = device if edge.nccl else torch.device("cpu")

    def recv(self) -> IntermediateTensors | list[IntermediateTensors]:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        self._broadcast(header)
        is_list, n_items, total, hidden, dtype, has_residual = header[:6].tolist()
        tokens = [total]
        if is_list:
            counts = torch.empty(n_items, dtype=torch.int64, device=self.device)
            self._broadcast(counts)
            tokens = counts.tolist()
        parts = 2 if has_residual else 1
        data = torch.empty(parts, total, hidden, dtype=_DTYPES[dtype], device=self.device)
        self._broadcast(data)
        hiddens = data[0].split(tokens)
        residuals = data[1].split(tokens) if has_residual else [None] * len(tokens)
        items = [IntermediateTensors(h, r) for h, r in zip(hiddens, residuals)]
        return items if is_list else items[0]

    def _broadcast(self, t: torch.Tensor) -> None:
        try:
            dist.broadcast(t, self.edge.src, group=self.edge.group)
        except RuntimeError as e:  # gloo/NCCL: the connection to the sender broke
            raise WriterDiedError(f"pipeline edge from rank {self.edge.src}: {e}") from e

    def close(self) -> None:
        pass
