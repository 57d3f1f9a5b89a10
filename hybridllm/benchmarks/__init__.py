"""Benchmarks: `bench serve` (an OpenAI-compatible server over HTTP), `throughput`, `latency`."""
