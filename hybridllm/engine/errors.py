"""The error that says the engine can no longer run, shared by the executors, engine and server."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more requests: a worker died (killed, or an exception in a
    step), the device failed, or the thread that drives the engine stopped or shut down.

    When a worker died, the message names it (rank, stage, device, exit code) and, when it
    managed to send one, the worker's own traceback. The server answers it with a 503.
    """
