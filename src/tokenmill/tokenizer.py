"""Tokenizer loading: a Hugging Face fast tokenizer (chat template included)."""

from __future__ import annotations

from tokenmill import hf_cache


def load_tokenizer(path: str):
    tok = hf_cache.load_tokenizer(path)  # AutoTokenizer's, its choice of class remembered across starts
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"tokenizer at {path!r} is not a fast tokenizer (tokenizer.json needed)")
    return tok
