"""Mutation check: apply known-wrong variants of jspec's exact paths and show the tests fail.

Each mutant is one textual change to one library file (the original text must occur exactly
once, so a refactor that moves the code makes the script fail loudly instead of testing
nothing). For each, the repository is copied to a scratch directory, the change applied, and the
default-run tests that guard that path are run there (`-m 'not slow'`, restricted to the listed
files and `-k` subsets of the default suite, so the check takes minutes, not hours: a subset that
fails means the default suite fails). A
mutant is *killed* when pytest fails. The score and each result go to stdout and, with
`--markdown FILE`, to a table (docs/TESTING.md quotes it).

    python scripts/mutation_check.py [--only NAME ...] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # one line: the bug it plants
    path: str  # file, relative to the repository root
    old: str
    new: str
    tests: tuple[str, ...]  # pytest files / node ids (default run) that must catch it
    k: str = ""  # optional -k expression narrowing them (a subset of the default run)


MUTANTS = (
    Mutant("residual-from-p", "on rejection, draw from p instead of norm([p - q]+)",
           "jspec/verify/lossless.py",
           "resid = jnp.maximum(p_n - q_n, 0.0)", "resid = p_n + 0.0 * q_n",
           ("tests/test_exact_law.py", "tests/test_speculative.py"),
           k="chain_exact or converges or distribution"),
    Mutant("q-filtered-differently", "the draft model draws its token from the unfiltered "
           "distribution while its q (and p) are top-k / top-p filtered",
           "jspec/drafters/draft_model.py",
           "return (categorical(keys[i], z),",
           "return (categorical(keys[i], out.logits[:, -1] / sampling.temperature),",
           ("tests/test_distribution.py",), k="top_k"),
    Mutant("bonus-wrong-slot", "after K accepted drafts, the bonus token comes from p at slot "
           "K-1 instead of K", "jspec/verify/lossless.py",
           "return n, residual(p[rows, n], q_n), prob",
           "return n, residual(p[rows, jnp.minimum(n, k - 1)], q_n), prob",
           ("tests/test_exact_law.py", "tests/test_speculative.py"),
           k="chain_exact or every_slot or converges or distribution"),
    Mutant("libraspec-token-confidence", "LibraSpec's confidence is the sampled token's own "
           "probability (the rule before 2026-12-01)", "jspec/drafters/trained.py",
           "return vocab_ids[idx].astype(jnp.int32), q_d, jnp.max(q_d, axis=-1)",
           "return vocab_ids[idx].astype(jnp.int32), q_d, "
           "jnp.take_along_axis(q_d, idx[..., None], axis=-1)[..., 0]",
           ("tests/test_libraspec.py::test_libraspec_exact_marginals_when_lengths_are_cut",)),
    Mutant("libraspec-no-floor", "LibraSpec cuts a length back below a block anchored on a "
           "sampled token", "jspec/length.py",
           "return d, want, stop, jnp.where(stop, floor, end(j - 1))",
           "return d, want, stop, floor",
           ("tests/test_exact_law.py::test_libraspec_floor_exact_and_no_floor_caught",
            "tests/test_libraspec.py::test_libraspec_exact_marginals_when_lengths_are_cut")),
    Mutant("tree-clamp", "a drawn tree renormalises a child's q by max(sum, 1e-30) (the bug of "
           "issue 56: rows with 1.2e-38 < sum < 1e-30 left unnormalised)", "jspec/verify/tree.py",
           "r = r / jnp.sum(r, axis=-1, keepdims=True)",
           "r = r / jnp.maximum(jnp.sum(r, axis=-1, keepdims=True), 1e-30)",
           ("tests/test_exact_law.py", "tests/test_distribution_low_t.py"), k="drawn_tree"),
    Mutant("tree-with-replacement", "a drawn tree verifies each child with its full q, as if "
           "siblings were drawn with replacement", "jspec/verify/tree.py",
           "jnp.where(tried | (r < _TINY), 0.0, r)", "jnp.where(r < _TINY, 0.0, r)",
           ("tests/test_exact_law.py", "tests/test_distribution_low_t.py"), k="drawn_tree"),
    Mutant("commit-last-off-by-one", "commit keeps the token after the last committed one as "
           "`last`", "jspec/state.py",
           "new_last = jnp.take_along_axis(emitted, jnp.maximum(count - 1, 0)[:, None], axis=1)",
           "new_last = jnp.take_along_axis(emitted, jnp.minimum(count, m - 1)[:, None], axis=1)",
           ("tests/test_speculative.py",), k="greedy_speculative_equals"),
    Mutant("commit-seq-off-by-one", "commit writes committed tokens one slot early in `seq` "
           "(what the n-gram drafter and the cache invariant read)", "jspec/state.py",
           "seq_slot = jnp.where(keep, state.cache.lengths[:, None] + 1 + j, state.seq.shape[1])",
           "seq_slot = jnp.where(keep, state.cache.lengths[:, None] + j, state.seq.shape[1])",
           ("tests/test_speculative.py",), k="greedy_speculative_equals or committed_sequence"),
    Mutant("asd-free-regret", "ASD admits mismatches without spending the request budget",
           "jspec/verify/asd.py",
           "new = dataclasses.replace(vstate, budget=vstate.budget - spent)",
           "new = dataclasses.replace(vstate, budget=vstate.budget - 0.0 * spent)",
           ("tests/test_asd.py",), k="budget"),
    Mutant("diversed-late-records", "DIVERSED records land n+1 slots late (the bug fixed on "
           "2026-12-01)", "jspec/verify/diversed.py",
           "slots = s.count[:, None] + idx  # token index of position i (before this round)",
           "slots = s.count[:, None] + idx + n[:, None] + 1", ("tests/test_diversed.py",),
           k="records"),
)


def apply(root: Path, m: Mutant) -> None:
    f = root / m.path
    text = f.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutant {m.name}: the original text occurs {text.count(m.old)} times "
                         f"in {m.path} (expected once); update the mutant")
    f.write_text(text.replace(m.old, m.new))


def run(m: Mutant, timeout: float) -> tuple[bool, float, str]:
    """(killed, seconds, last line of pytest's output) for one mutant in a scratch copy."""
    with tempfile.TemporaryDirectory(prefix=f"jspec-mut-{m.name}-") as tmp:
        root = Path(tmp) / "repo"
        shutil.copytree(ROOT, root, ignore=shutil.ignore_patterns(
            ".git", "runs", "__pycache__", "*.egg-info", ".ruff_cache"))
        apply(root, m)
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow",
               "-p", "no:cacheprovider", *m.tests, *(("-k", m.k) if m.k else ())]
        env = {**os.environ, "PYTHONPATH": str(root)}
        where = subprocess.run([sys.executable, "-c", "import jspec; print(jspec.__file__)"],
                               cwd=root, capture_output=True, text=True, env=env).stdout
        if not where.startswith(str(root)):
            raise SystemExit(f"the scratch copy imports jspec from {where!r}, not {root}")
        try:
            res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout,
                                 env=env)
            out = (res.stdout + res.stderr).strip().splitlines()
            last = out[-1] if out else ""
            killed = res.returncode != 0
        except subprocess.TimeoutExpired:
            killed, last = False, f"timed out after {timeout:.0f} s (counted as survived)"
        return killed, time.perf_counter() - t0, last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="mutant names to run (default: all)")
    ap.add_argument("--markdown", help="write the results table to this file")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    a = ap.parse_args()
    todo = [m for m in MUTANTS if not a.only or m.name in a.only]
    if a.list:
        for m in MUTANTS:
            print(f"{m.name}: {m.what} ({m.path}; {', '.join(m.tests)})")
        return
    if a.only and len(todo) != len(a.only):
        raise SystemExit(f"unknown mutant in {a.only}; --list shows them")
    rows = []
    for m in todo:
        killed, secs, last = run(m, a.timeout)
        rows.append((m, killed, secs, last))
        print(f"{'KILLED  ' if killed else 'SURVIVED'} {m.name:28s} {secs:6.0f} s  {last}",
              flush=True)
    score = sum(k for _, k, _, _ in rows)
    print(f"mutation score: {score}/{len(rows)} killed")
    if a.markdown:
        lines = ["| mutant | planted bug | tests run (default selection) | result | time |",
                 "|---|---|---|---|---|"]
        for m, killed, secs, last in rows:
            lines.append(f"| `{m.name}` | {m.what} | {', '.join(f'`{t}`' for t in m.tests)} | "
                         f"{'killed' if killed else 'SURVIVED'}: {last} | {secs:.0f} s |")
        lines.append(f"\nScore: {score}/{len(rows)} killed.")
        Path(a.markdown).write_text("\n".join(lines) + "\n")
    sys.exit(0 if score == len(rows) else 1)


if __name__ == "__main__":
    main()
