"""Building blocks shared by the model families: norms, rotary embedding, attention backends."""
