"""Exactness of one round, by enumeration rather than sampling (tests/exact_law.py): chains,
trees drawn from q (depth 1 and 2) and LibraSpec's lengths, on 4-token vocabularies, at
T = 0.05, 0.1, 0.3 and 1, with drafter tables whose tails put the mass left after the first
draws in every float32 regime. The law of the emitted tokens (completed by the target's own
law where a round stopped early) must equal the target's: total variation ≤ TOL = 1e-5, the
float32 rounding of p and q (measured ≤ 3.1e-7; the bugs these tests exist for give 5e-5 to
0.76). Control: every enumeration's weights sum to 1 within 1e-6 (a wrong weight, or a forced
uniform that missed its pattern, breaks it). Broken variants that must fail: a drawn tree
verified with q² renormalised, and LibraSpec without its floor. Seeds: numpy
default_rng(seed) per case, as listed. Against the 1e-30 clamp verify_tree_drawn had (issue
56), 12-17 of the 24 table pairs per tree shape fail, TV up to 0.76 (docs/TESTING.md).
"""
from __future__ import annotations

import numpy as np
import pytest
from exact_law import chain_law, drawn_tree_law, libraspec_law

from jspec.length import LibraSpec

TOL = 1e-5
TEMPERATURES = (0.05, 0.1, 0.3, 1.0)
V = 4
# What is left of a drafter row's mass after its first draws, by the log-probability gap (in
# nats, after the temperature) of the tokens below the mode: normal float32 (> 1e-26); 1.2e-38
# .. 1e-30 (normal, below the 1e-30 clamp verify_tree_drawn had); below float32's smallest
# normal (flushed to 0 by XLA:CPU, explicitly elsewhere).
REGIMES = {"normal": (0.5, 60.0), "clamp-zone": (69.5, 86.5), "flushed": (88.5, 140.0)}


def regime_table(rng: np.random.Generator, t: float) -> np.ndarray:
    """f32-exact f64[V, V] logits: each row's mode, and the others' gaps below it drawn from
    a random regime each (so a row's tail mass after one, two, three draws lands anywhere)."""
    out = np.empty((V, V))
    names = list(REGIMES)
    for r in range(V):
        gaps = np.asarray([rng.uniform(*REGIMES[names[rng.integers(3)]]) for _ in range(V)])
        gaps[rng.integers(V)] = 0.0
        out[r] = -t * gaps
    return out.astype(np.float32).astype(np.float64)


def natural_table(rng: np.random.Generator) -> np.ndarray:
    """f32-exact f64[V, V] logits: Gaussian with a lead of 0..10 on one token per row (the same
    table at every temperature: peaked at low T)."""
    x = rng.normal(0.0, 2.0, (V, V))
    x[np.arange(V), rng.integers(V, size=V)] += rng.uniform(0, 10, V)
    return x.astype(np.float32).astype(np.float64)


def tables(seed: int, t: float, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(target logits, drafter logits) for one case. "regime": a drafter `regime_table` and a
    target whose p is Dirichlet(1) rows at every T (logits T·log p: the target keeps mass on
    the drafter's tail tokens, where a misnormalised q shows); "natural": two `natural_table`s."""
    rng = np.random.default_rng(seed)
    if kind == "regime":
        p = rng.dirichlet(np.ones(V), size=V)
        return (t * np.log(p)).astype(np.float32).astype(np.float64), regime_table(rng, t)
    return natural_table(rng), natural_table(rng)


def tail_regimes(d: np.ndarray, t: float) -> set[str]:
    """The regimes of the mass a drafter table leaves after its rows' first one and two draws
    (the q a second / third sibling is verified with is renormalised by it)."""
    z = d / t
    z = z - z.max(-1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    srt = np.sort(lp, axis=-1)[:, ::-1]
    out = set()
    for j in (1, 2):
        m = srt[:, j:].max(-1)
        log_tail = m + np.log(np.exp(srt[:, j:] - m[:, None]).sum(-1))
        for x in log_tail:
            out.add("flushed" if x < np.log(np.finfo(np.float32).tiny) else
                    "clamp-zone" if x < np.log(1e-30) else "normal")
    return out


CASES = [(t, kind, seed) for t in TEMPERATURES for kind, seeds in
         (("regime", range(4)), ("natural", range(2))) for seed in seeds]


@pytest.mark.parametrize("depth,k,width,nodes", [(1, 3, 1, 3), (2, 3, 1, 6), (2, 2, 2, 5)],
                         ids=["depth1-k3", "depth2-k3", "depth2-k2-width2-5nodes"])
def test_drawn_tree_exact_at_every_temperature(depth, k, width, nodes):
    """A tree drawn from q (the real `expand_tree`, every draw order enumerated) and verified
    by recursive rejection sampling (the real `walk_drawn`): the emitted tokens' law is the
    target's, TV ≤ TOL, over 24 table pairs (4 temperatures × 4 regime + 2 natural tables,
    seeds 0-3 / 0-1) whose draft tails cover every float32 regime; and the issue's
    counterexample (T = 0.1, draft logits [10, 2, 2, 2], p = [0.1, 0.6, 0.2, 0.1]: TV 0.30
    with the old 1e-30 clamp)."""
    seen, worst = set(), 0.0
    for t, kind, seed in CASES:
        a, d = tables(seed, t, kind)
        seen |= tail_regimes(d, t)
        root = seed % V
        tv, total = drawn_tree_law(a, d, root, t, depth, k, width, nodes)
        assert abs(total - 1.0) < 1e-6, (t, kind, seed, total)
        assert tv <= TOL, (t, kind, seed, tv)
        worst = max(worst, tv)
    assert seen == set(REGIMES), seen
    t = 0.1
    a = np.tile(t * np.log([0.1, 0.6, 0.2, 0.1]), (V, 1))
    d = np.tile([10.0, 2.0, 2.0, 2.0], (V, 1))
    tv, total = drawn_tree_law(a, d, 0, t, depth, k, width, nodes)
    assert tv <= TOL and abs(total - 1.0) < 1e-6, (tv, total)


def test_drawn_tree_broken_variant_is_caught():
    """The same enumeration rejects a drawn tree verified with q² renormalised in place of
    the q its children were drawn from (depth 2, k 3; T = 1, natural tables, seeds 0 and 1):
    TV > 1e-3 in each, while the weights still sum to 1."""
    for t, seed in ((1.0, 0), (1.0, 1)):
        a, d = tables(seed, t, "natural")
        tv, total = drawn_tree_law(a, d, 0, t, 2, 3, q_of=lambda q: q * q / (q * q).sum(
            -1, keepdims=True).clip(1e-30))
        print(f"q² broken variant, seed {seed}: TV {tv:.3g}")
        assert abs(total - 1.0) < 1e-6 and tv > 1e-3, (t, tv, total)


def test_chain_exact_at_every_temperature():
    """A 3-token chain drawn from the Markov drafter (every chain enumerated) verified by the
    real `decide_chain`: TV ≤ TOL over the same 24 table pairs (a tail draw whose q underflows
    to 0 is verified as a deterministic slot)."""
    for t, kind, seed in CASES:
        a, d = tables(seed, t, kind)
        tv, total = chain_law(a, d, seed % V, 3, t)
        assert abs(total - 1.0) < 1e-6 and tv <= TOL, (t, kind, seed, tv, total)


def floor_case() -> tuple[np.ndarray, np.ndarray]:
    """(target, drafter tables) where LibraSpec(n=2, d_max=6, α=4.5) with blocks of 3 extends
    d = 2 → 6 (blocks 1 and 2 drafted: block 2 is anchored on the token at slot 5), then cuts:
    ε* = 5 when slot 6's confidence is 0.9 (x_5 = 0) and 4 when it is 0.25 (x_5 ≠ 0). The
    floor keeps slot 5 verified either way; without it, slot 5 is verified only when its own
    token is 0 (confidences per slot: 0.9, 0.9, 0.25, 0.5, 0.4, 0.9 | 0.25). The target: every
    next token (0.7, 0.1, 0.1, 0.1)."""
    def row(*p):
        return np.log(np.asarray(p))

    flat, sure = row(.25, .25, .25, .25), row(.9, 1 / 30, 1 / 30, 1 / 30)
    table = np.empty((8, V, V))
    table[:] = flat
    table[0], table[1] = sure, sure
    table[3], table[4] = row(.5, 1 / 6, 1 / 6, 1 / 6), row(.4, .2, .2, .2)
    table[5, 0] = sure  # anchored on x_5 = 0: confident
    return np.tile(row(.7, .1, .1, .1), (V, 1)), table


@pytest.mark.parametrize("t", [1.0, 0.1])
def test_libraspec_floor_exact_and_no_floor_caught(t):
    """LibraSpec's lengths from the real `libraspec_draft` over every draft of a sampling block
    drafter (4⁶ drafts, `floor_case`, logits scaled by T so q is the same at T = 1 and 0.1):
    with the floor the law is the target's (TV ≤ TOL); without it (the length rule run as for
    greedy tokens) TV ≈ 0.034 (asserted > 0.02); both enumerations' weights sum to 1; lengths
    differ between drafts without the floor (4 or 5) and are 5 with it."""
    a, table = floor_case()
    policy = LibraSpec(n=2, d_max=6, alpha=4.5)
    tv, total, d = libraspec_law(t * a, t * table, 0, t, policy, block=3)
    assert tv <= TOL and abs(total - 1.0) < 1e-6, (tv, total)
    assert (d == 5).all(), np.bincount(d)
    tv, total, d = libraspec_law(t * a, t * table, 0, t, policy, block=3, floor=False)
    assert tv > 0.02 and abs(total - 1.0) < 1e-6, (tv, total)
    assert set(np.unique(d)) == {4, 5}, np.bincount(d)


def test_libraspec_random_tables_exact():
    """LibraSpec(n=1, d_max=4, α = 2) with blocks of 2 over random peaked drafter and target
    tables (V = 4; seeds 0-3 at T = 0.1, 1, 1, 0.1): TV ≤ TOL, weights sum to 1; in some of
    them the length differs between drafts."""
    varied = False
    for seed, t in ((0, 0.1), (1, 1.0), (2, 1.0), (3, 0.1)):
        rng = np.random.default_rng(seed)
        a = natural_table(rng)
        table = np.stack([natural_table(rng) for _ in range(5)])
        policy = LibraSpec(n=1, d_max=4, alpha=2.0)
        tv, total, d = libraspec_law(a, table, seed % V, t, policy, block=2)
        assert tv <= TOL and abs(total - 1.0) < 1e-6, (seed, t, tv, total)
        varied |= len(np.unique(d)) > 1
    assert varied
