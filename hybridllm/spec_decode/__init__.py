"""Speculative decoding, engine side: drafting each request's next tokens (no torch)."""
