"""Speculative decoding: the controller that owns it and its proposers (pure Python; the draft
model's proposer, spec_decode/draft_model.py, runs a model and is imported only by the engine)."""

from octavo.spec_decode.controller import Proposer, SpecDecodeController, best_num_drafts, make_proposer
from octavo.spec_decode.ngram import NgramDrafter
from octavo.spec_decode.suffix import SuffixDrafter

__all__ = ["NgramDrafter", "Proposer", "SpecDecodeController", "SuffixDrafter", "best_num_drafts", "make_proposer"]
