"""Token encoding and decoding: tokenizer loading, chat templates, incremental detokenization, stop strings."""
