"""HTTP API: OpenAI Chat Completions / Completions, admin endpoints (models, health, metrics, tokenize)."""
