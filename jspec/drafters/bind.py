"""`bind`: a drafter whose copies of the target's tensors come from given target weights.

EAGLE-3 and DFlash hold the target's embedding and its LM-head rows of the draft vocabulary;
`early-exit:N` holds the target's weights. In an RL loop the target (the policy) changes every
step: a drafter left with the old tensors stays lossless but accepts less. `bind(drafter,
weights)` is a pure function of arrays (jittable; no host reads, no recompile when only the
weights' values change), so the loop re-binds inside its own jit:

    def step(weights, drafter, ids, lengths, key):
        d = jspec.bind(drafter, weights)
        out = jspec.generate(dataclasses.replace(model, weights=weights), ids, lengths,
                             drafter=d, key=key, length=jspec.FixedLength(4))

The drafter's own parameters are unchanged (train them apart). Tensors an imported checkpoint
brought itself (its own `lm_head`, its own embedding) are not the target's: they stay.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from jspec.drafters.base import Proposer
from jspec.drafters.d2sd import D2SD
from jspec.drafters.dflash import DFlash
from jspec.drafters.draft_model import DraftModel
from jspec.drafters.eagle3 import Eagle3
from jspec.drafters.trained import draft_head
from jspec.models.llama import Weights

D = TypeVar("D")


def bind(drafter: D, target_weights: Weights) -> D:
    """The drafter with its copies of the target's tensors taken from `target_weights`.

    Args:
      drafter: any jspec drafter (or None). EAGLE-3 / DFlash: the embedding [V, D] and the
        LM-head rows of the draft vocabulary [Vd, D] (in the target's dtype) are replaced;
        `early-exit:N` (a `DraftModel` with `shares_target`): its weights; D²SD: both of its
        DFlash drafters; a proposer (`+topk`, `+ngram`): its inner drafter. Others (n-gram,
        an independent draft model) hold nothing of the target's and are returned as they are.
      target_weights: the target's weights, e.g. a policy after an optimizer step (may be
        traced).
    Returns:
      a drafter of the same type and static configuration (the same compiled program), equal
      to one freshly built for a target with these weights.
    """
    if isinstance(drafter, (Eagle3, DFlash)):
        repl: dict[str, Any] = {}
        if not drafter.own_embed:
            repl["embed"] = target_weights.embed
        if not drafter.own_head:
            repl["head"] = draft_head(drafter.vocab_ids, target_weights)
        return dataclasses.replace(drafter, **repl)
    if isinstance(drafter, DraftModel):
        return (dataclasses.replace(drafter, weights=target_weights) if drafter.shares_target
                else drafter)
    if isinstance(drafter, D2SD):
        return dataclasses.replace(drafter, first=bind(drafter.first, target_weights),
                                   second=bind(drafter.second, target_weights))
    if isinstance(drafter, Proposer):
        return dataclasses.replace(drafter, inner=bind(drafter.inner, target_weights))
    return drafter


def share_target(drafter: D, target_weights: Weights) -> D:
    """The drafter with every `early-exit:N` (a `DraftModel` with `shares_target`, also inside
    a proposer) reading the given target weights: what `generate` applies inside its program, so
    that the target's weights enter it once. (A stacked target's layers are used whole by the
    drafter's scan, so a second copy was not dropped as unused: an 8B early-exit `generate`
    asked for 31.6 GB of one v6e chip's 31.25.) Other drafters are returned as they are."""
    if isinstance(drafter, DraftModel) and drafter.shares_target:
        return dataclasses.replace(drafter, weights=target_weights)
    if isinstance(drafter, Proposer):
        return dataclasses.replace(drafter, inner=share_target(drafter.inner, target_weights))
    return drafter
