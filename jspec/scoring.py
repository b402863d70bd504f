"""Teacher-forced log-probs of completions: what a policy-gradient loss recomputes under the
current parameters, equal to what `generate(...).logprobs` reported for the same tokens.

    out = jspec.generate(policy, ids, lens, sampling=s, key=key, ...)
    lp_old = out.logprobs                                        # f32[B, N], no gradient needed
    lp_new = jspec.logprobs(policy, ids, lens, out.tokens, sampling=s)   # differentiable
    ratio = jnp.exp(lp_new - lp_old)

One forward over prompt + completion (right-padded rows: causal attention never lets a pad
reach an earlier position), the LM head only on the N positions that predict a completion
token, then the processing `generate` sampled with (`jspec.sampling.process_logits`:
temperature, top-k, top-p, per-row values included). Pure and jittable; the weights may be
traced and differentiated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.models import KVCache, forward
from jspec.models.llama import lm_logits
from jspec.models.model import Model
from jspec.sampling import Sampling, process_logits, processed_logprobs


def logprobs(model: Model, ids: jax.Array, lens: jax.Array, tokens: jax.Array, *,
             sampling: Sampling = Sampling(), processed: bool = True) -> jax.Array:
    """f32[B, N]: log p of each completion token given the prompt and the tokens before it.

    Args:
      model: the target (policy); its weights may be traced.
      ids: i32[B, W] right-padded prompts.
      lens: i32[B] the prompts' real lengths.
      tokens: i32[B, N] completions as `generate` returns them: -1 after a row's end.
      sampling: the distribution the tokens were drawn from; log p is under its processed
        logits (greedy: the plain softmax), as `GenerateOutput.logprobs` is.
      processed: False gives log p under the unprocessed softmax instead (what a KL term to a
        reference model wants).
    Returns:
      log-probs, 0 at and after each row's first -1.
    """
    cfg = model.config
    b, w = ids.shape
    n = tokens.shape[1]
    length = jnp.sum(jnp.cumprod(tokens >= 0, axis=1), axis=1)  # i32[B]: tokens before a -1
    t = jnp.arange(w + n, dtype=jnp.int32)[None]
    rel = t - lens[:, None]  # index into the completion
    comp = jnp.take_along_axis(jnp.maximum(tokens, 0), jnp.clip(rel, 0, n - 1), axis=1)
    seq = jnp.where(t < lens[:, None], jnp.pad(ids, ((0, 0), (0, n))),
                    jnp.where(rel < length[:, None], comp, 0))
    cache = KVCache.create(cfg, b, w + n)
    h = forward(cfg, model.weights, seq, jnp.broadcast_to(t, (b, w + n)), cache,
                compute_logits=False).final_hidden  # [B, W+N, D]
    at = lens[:, None] - 1 + jnp.arange(n)[None]  # the position that predicts token i
    h = jnp.take_along_axis(h, at[..., None], axis=1)  # [B, N, D]
    logits = lm_logits(cfg, model.weights, h).astype(jnp.float32)  # [B, N, V]
    z = process_logits(logits, sampling) if processed else logits
    lp = processed_logprobs(z, jnp.maximum(tokens, 0))
    return jnp.where(jnp.arange(n)[None] < length[:, None], lp, 0.0)
