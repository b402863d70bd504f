"""Many prompts, `batch_size` at a time: bucketed widths, one compile per bucket, input order.

`generate_batches` is what `python -m jspec generate --prompts-file F --batch-size N` runs:
prompts are sorted by length so that a batch holds similar widths, each batch is padded to its
width bucket (`jspec.state.bucket_length`) and, the last one included, to `batch_size` rows
(a short batch repeats its first prompt; those rows are discarded), so every batch of a bucket
reuses one compiled program. Results come back in input order, as soon as every earlier one is
done.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from jspec import sharding
from jspec.decode import generate
from jspec.errors import JspecError
from jspec.inputs import right_pad
from jspec.models.model import Model
from jspec.sampling import Sampling
from jspec.state import bucket_length


@dataclasses.dataclass(frozen=True)
class PromptResult:
    index: int  # position of the prompt in the input
    tokens: list[int]  # new tokens (EOS included when emitted)
    rounds: int  # target verify passes after the prompt's
    mean_accepted: float  # tokens committed per round (accepted drafts + 1)
    seconds: float  # wall time of the batch it was decoded in


def batch_plan(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Prompt indices per batch: sorted by length (stable), `batch_size` per batch."""
    if batch_size < 1:
        raise JspecError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def generate_batches(model: Model, prompts: Sequence[Sequence[int]], batch_size: int, *,
                     max_new_tokens: int = 128, sampling: Sampling = Sampling(),
                     key: jax.Array | None = None, drafter: Any = None, length: Any = None,
                     verifier: Any = None, mesh: Any = None) -> Iterator[PromptResult]:
    """Decode token-id prompts `batch_size` at a time; yield one `PromptResult` per prompt, in
    input order.

    Batch j samples with `jax.random.fold_in(key, j)`: with sampling, a prompt's output depends
    on which batch it lands in (greedy output does not).
    """
    if not prompts:
        raise JspecError("no prompts")
    key = jax.random.key(0) if key is None else key
    plan = batch_plan([len(p) for p in prompts], batch_size)
    done: dict[int, PromptResult] = {}
    nxt = 0
    for j, rows in enumerate(plan):
        batch = [prompts[i] for i in rows]
        ids, lens = right_pad(batch, bucket_length(max(map(len, batch))), batch_size)
        t0 = time.perf_counter()
        out = generate(model, ids, lens, drafter=drafter, max_new_tokens=max_new_tokens,
                       sampling=sampling, verifier=verifier, length=length,
                       key=jax.random.fold_in(key, j), mesh=mesh)
        tokens, n, stats = sharding.to_host((out.tokens, out.lengths, out.stats))
        secs = time.perf_counter() - t0
        tau = stats.mean_accepted()
        for r, i in enumerate(rows):
            done[i] = PromptResult(index=i, tokens=[int(t) for t in tokens[r, :int(n[r])]],
                                   rounds=int(stats.rounds[r]),
                                   mean_accepted=float(tau[r]), seconds=secs)
        while nxt in done:
            yield done.pop(nxt)
            nxt += 1
