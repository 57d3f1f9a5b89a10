"""Entry points: the `LLM` class, the OpenAI-compatible server and the CLI."""
