"""`IntermediateTensors`: what one pipeline stage hands the next (hidden states and residual)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# dtypes numpy cannot hold travel as a same-width integer view
_NUMPY_VIEW = {torch.bfloat16: torch.int16}


@dataclass
class IntermediateTensors:
    """The activations between two stages, both [num_tokens, hidden].

    `ready` is a CUDA event recorded after an asynchronous device-to-host copy: the
    receiving stage waits on it (not on the whole stream), so a GPU stage can already run
    the next micro-batch while a CPU stage consumes this one.
    """

    hidden_states: torch.Tensor  # [num_tokens, hidden]
    residual: torch.Tensor | None  # [num_tokens, hidden]; None where the model folds it in
    ready: torch.cuda.Event | None = None

    @property
    def num_tokens(self) -> int:
        return self.hidden_states.shape[0]

    def to(self, device: torch.device) -> IntermediateTensors:
        """The tensors on `device`; waits for a pending asynchronous copy first."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.hidden_states.device == device:
            return IntermediateTensors(self.hidden_states, self.residual)
        return IntermediateTensors(
            self.hidden_states.to(device),
            None if self.residual is None else self.residual.to(device),
        )

    def start_copy_to(self, device: torch.device) -> IntermediateTensors:
        """Begin moving the tensors to `device` without waiting for the copy to finish.

        GPU to CPU goes into pinned memory behind a recorded event; any other pair of
        devices is left to `to()`, which the receiver calls anyway.
        """
        src = self.hidden_states.device
        if src.type != "cuda" or device.type != "cpu":
            return self
        pinned = [_pinned_copy(t) for t in (self.hidden_states, self.residual)]
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(src))
        return IntermediateTensors(pinned[0], pinned[1], event)

    def __reduce__(self):
        # Numpy arrays pickle (protocol 5) as out-of-band buffers: one copy into shared
        # memory instead of torch's storage serialisation.
        arrays = tuple(None if t is None else _to_numpy(t) for t in self._cpu_tensors())
        return _rebuild, (arrays, str(self.hidden_states.dtype).removeprefix("torch."))

    def _cpu_tensors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        cpu = self.to(torch.device("cpu"))
        return cpu.hidden_states, cpu.residual


def _pinned_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    view = _NUMPY_VIEW.get(t.dtype)
    return (t.view(view) if view is not None else t).numpy()


def _from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if not a.flags.writeable:  # arrays unpickled straight from a zmq frame are read-only
        a = a.copy()
    t = torch.from_numpy(a)
    return t.view(dtype) if dtype in _NUMPY_VIEW else t


def _rebuild(arrays: tuple[np.ndarray | None, ...], dtype_name: str) -> IntermediateTensors:
    dtype = getattr(torch, dtype_name)
    hidden, residual = (None if a is None else _from_numpy(a, dtype) for a in arrays)
    return IntermediateTensors(hidden, residual)
