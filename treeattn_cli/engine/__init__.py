"""What runs in a rank: the engine and its requests, the model, attention, prefill, decode, the cache."""
