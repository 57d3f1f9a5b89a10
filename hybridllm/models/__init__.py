"""Model implementations (one per HF architecture) and the architecture registry."""
