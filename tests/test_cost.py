"""jspec.cost on a tiny model: the verify cost curve of a chain and of a tree, and the compiled
forward a timer calls."""

import numpy as np
from conftest import tiny_model

from jspec import cost


def test_cost_curve_of_a_chain_and_a_tree():
    model = tiny_model()
    chain = cost.cost_curve(model, (1, 4), fill=5, repeats=2)
    assert chain["fill"] == 5 and chain["c"][1] == 1.0 and set(chain["ms"]) == {1, 4}
    tree = cost.cost_curve(model, (1, 4), fill=5, repeats=2,
                           parents_of=lambda n: np.asarray([-1, 0, 0, 1][:n]))
    assert tree["c"][1] == 1.0 and tree["ms"][4] > 0
    np.testing.assert_array_equal(cost.tree_depth(np.asarray([-1, 0, 0, 1])), [0, 1, 1, 2])


def test_forward_call_reads_the_filled_cache_and_leaves_it():
    model = tiny_model()
    cache = cost.filled_cache(model, 5, 32)
    call = cost.forward_call(model, 3, 5, cache)
    logits, _ = call()
    assert logits.shape == (1, 3, model.config.vocab_size) and int(cache.lengths[0]) == 5
