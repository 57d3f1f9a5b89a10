"""Executors: how the engine reaches its workers (in-process, one process each, or remote)."""
