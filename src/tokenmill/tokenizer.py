"""Tokenizer loading: a Hugging Face fast tokenizer (chat template included)."""

from __future__ import annotations


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"tokenizer at {path!r} is not a fast tokenizer (tokenizer.json needed)")
    return tok
