"""The engine: requests, KV blocks, scheduling, model execution, sampling."""
