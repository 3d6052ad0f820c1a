"""Speculative decoding building blocks: configuration and draft proposers (n-gram prompt
lookup, suffix decoding, a draft model); exact verification by rejection sampling is in sample/. The scheduler, runner and
engine wire them in; nothing here touches a model."""

from tokenmill.sample.rejection import VerifyOutput, rejection_sample, target_distributions
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.ngram import NgramProposer, TokenBuffer
from tokenmill.spec_decode.suffix import SuffixDraft, SuffixProposer

__all__ = [
    "NgramProposer",
    "SpeculativeConfig",
    "SuffixDraft",
    "SuffixProposer",
    "TokenBuffer",
    "VerifyOutput",
    "rejection_sample",
    "target_distributions",
]
