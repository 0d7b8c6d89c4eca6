"""Qwen3.5 models in transformers: config mapping, tokenizers and processors built in code, model construction."""
