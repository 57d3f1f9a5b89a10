"""Workers: one per device, running its share of the model."""
