"""Building blocks shared by the models: norms, rotary embedding, linear layers, paged attention."""
