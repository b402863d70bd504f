"""Will a `generate` fit? A cheap estimate first, XLA's own plan when it is close.

`estimate_bytes` counts what grows with the batch: the target KV cache, the float32 logits and
probabilities of a verify pass over k + 1 tokens (three [B, k+1, V] arrays live at once: the
logits, p and the verifier's working copy), the drafter's draft distributions and its own
caches, and the prefill's attention scores. `check_fits` compares it with the memory the
device has free; only when the estimate passes half of it does it compile the program and read
XLA's `memory_analysis` (exact for that program), and it raises a `JspecError` naming the need,
what is free and the largest batch that would fit (the batch-dependent part scaled linearly).
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from jspec.errors import JspecError

GiB = 2**30


def device_stats(device: Any = None) -> dict[str, int] | None:
    """The device's (default: the first one's) `bytes_in_use`, `peak_bytes_in_use` (the
    process's running peak) and `bytes_limit` where its backend reports them (GPU/TPU), else
    None (CPU)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    except Exception:  # some backends raise instead of returning None
        return None
    if not stats:
        return None
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
            if k in stats}


def free_bytes(device: Any = None) -> int | None:
    """Memory the device can still allocate: `bytes_limit - bytes_in_use` where the backend
    reports it (GPU/TPU), else the host's MemAvailable (CPU); None when unknown."""
    stats = device_stats(device)
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def estimate_bytes(config: Any, batch: int, capacity: int, k: int, prompt_width: int,
                   drafter: Any = None) -> int:
    """Bytes of the batch-dependent buffers of one `generate` (weights excluded)."""
    item = jax.numpy.dtype(config.jnp_dtype).itemsize
    cache = 2 * config.num_layers * batch * config.num_kv_heads * capacity * config.head_dim * item
    logits = 3 * batch * (k + 1) * config.vocab_size * 4
    scores = batch * config.num_heads * prompt_width * prompt_width * 4  # one prefill layer's
    ints = batch * (2 * capacity) * 4
    draft = 0
    if drafter is not None:
        # q over the drafter's vocabulary, and its scatter to all V for the verifier
        q_vocab = getattr(drafter, "q_vocab", None)
        vq = config.vocab_size if q_vocab is None else int(q_vocab.shape[0])
        draft = batch * max(k, 1) * (vq + config.vocab_size) * 4
        dcfg = getattr(drafter, "cfg", None)
        if dcfg is not None and hasattr(dcfg, "num_kv_heads"):
            layers = getattr(dcfg, "num_layers", 1) or 1
            draft += 2 * layers * batch * capacity * dcfg.num_kv_heads * dcfg.head_dim * 4
    return int(cache + logits + scores + ints + draft)


def check_fits(lower: Any, batch: int, estimate: int, free: int | None,
               weights_bytes: int) -> None:
    """Raise a clear error when the program for this batch would not fit in `free` bytes.

    Args:
      lower: a zero-argument function returning the `jax.stages.Lowered` program (called only
        when the estimate passes half of `free`).
      batch: its batch size; estimate: `estimate_bytes`; weights_bytes: already resident.
    """
    if free is None or estimate <= free // 2:
        return
    need = estimate
    if os.environ.get("JSPEC_MEMORY_CHECK", "1") != "0":
        m = lower().compile().memory_analysis()
        if m is not None:
            need = int(m.temp_size_in_bytes + m.output_size_in_bytes
                       + max(m.argument_size_in_bytes - weights_bytes, 0)
                       - m.alias_size_in_bytes)
    if need <= free:
        return
    largest = max(0, math.floor(batch * free / need))
    raise JspecError(f"batch {batch} needs ~{need / GiB:.1f} GiB beyond the weights and "
                     f"{free / GiB:.1f} GiB is free: it would not fit. The largest batch that "
                     f"would: about {largest} (or lower max_new_tokens / the speculation "
                     "length). Set JSPEC_MEMORY_CHECK=0 to use the estimate alone.")


def per_device_bytes(tree: Any, specs: Any, mesh: Mesh | AbstractMesh) -> int:
    """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) laid out by `specs`.

    Each dimension is divided by the product of the mesh axes its PartitionSpec entry names
    (no allocation: works on `jax.eval_shape` output and an AbstractMesh).
    """
    sizes = dict(mesh.shape)
    total = 0
    leaves = jax.tree.leaves(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    if len(leaves) != len(spec_leaves):
        raise JspecError("specs do not match the tree")
    for a, s in zip(leaves, spec_leaves, strict=True):
        n = 1
        entries = tuple(s) + (None,) * (len(a.shape) - len(tuple(s)))
        for dim, entry in zip(a.shape, entries, strict=True):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            div = int(np.prod([sizes[x] for x in axes])) if axes else 1
            n *= -(-dim // div)
        total += n * a.dtype.itemsize  # (PRNG key dtypes too)
    return int(total)
