"""The OpenAI-compatible HTTP server: protocol models, serving handlers, engine thread, metrics."""
