"""Llama-family models: config, layers, HF loader, tokenizers, radixkv-tiny, and ModelRunner."""
