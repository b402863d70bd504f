"""Drafters: one protocol (`propose`), several ways to guess the target's next tokens."""

from jspec.drafters.base import DraftContext, Drafter
from jspec.drafters.bind import bind
from jspec.drafters.draft_model import DraftModel, DraftModelState
from jspec.drafters.loading import load_drafter
from jspec.drafters.ngram import NGram

__all__ = ["DraftContext", "DraftModel", "DraftModelState", "Drafter", "NGram", "bind",
           "load_drafter"]
