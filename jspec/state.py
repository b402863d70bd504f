"""The state carried between decoding rounds, and the two steps every round shares.

`SpecState` (a registered dataclass pytree, donated between dispatches) holds the target cache,
the committed sequence, the output buffer, the PRNG key and the drafter's / verifier's states;
`prefill` creates it, `commit` appends a round's tokens (cut at EOS / `max_new_tokens`) and
advances the cache length. Fixed capacity everywhere: ragged acceptance never changes a shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models.blocks import rms_normalize
from jspec.models.cache import KVCache
from jspec.models.config import ModelConfig
from jspec.models.llama import Weights, forward, lm_logits
from jspec.sampling import Sampling, SamplingParams, sample_with_logprobs

INVALID = -1  # the padding value of output token buffers


def bucket_length(n: int) -> int:
    """Prompt widths are padded to a few buckets so that shapes (and compiles) stay few."""
    if n <= 32:
        return 32
    if n <= 256:
        return -(-n // 32) * 32
    return -(-n // 128) * 128


def capacity_multiple(platform: str | None) -> int:
    """What cache capacities are rounded up to in a program compiled for `platform`: 128 slots
    (a lane-wide Pallas tile) on TPU/GPU, and where the platform is not known at trace time
    (None: a user's jit without a mesh; 128 is valid everywhere); 32 on CPU, where the XLA
    attention reads every slot of the capacity each step (batch 64, 64 new tokens after 96-wide
    prompts: 192 slots instead of 256; docs/BENCHMARKS.md "Issue 18 closed out")."""
    return 32 if platform == "cpu" else 128


def cache_capacity(prompt_width: int, max_new_tokens: int, lookahead: int = 0,
                   platform: str | None = None) -> int:
    """Slots needed for the prompt, the new tokens and a verify block of `lookahead` drafts,
    rounded up to `capacity_multiple(platform)`."""
    need = prompt_width + max_new_tokens + lookahead + 1
    m = capacity_multiple(platform)
    return -(-need // m) * m


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Stats:
    """Per-row decoding statistics (all i32)."""

    rounds: jax.Array  # i32[B] target verify passes after prefill
    emitted: jax.Array  # i32[B] tokens committed by those rounds (accepted + bonus/correction)
    accepted: jax.Array  # i32[B] drafted tokens accepted
    drafted: jax.Array  # i32[B] proposed tokens put up for verification (not empty nodes)
    accepted_at: jax.Array  # i32[B, K] rounds in which draft position k was accepted
    # Σ over rounds of the oracle length (the longest drafted prefix the verifier would have
    # accepted, observed within the verified width, so a lower bound when it reaches that
    # width) and of |verified length − oracle length|. Under a fixed K the oracle is the
    # accepted count (exact for the lossless verifier; relaxed verifiers accept more).
    oracle: jax.Array  # i32[B]
    oracle_gap: jax.Array  # i32[B]

    @classmethod
    def zeros(cls, batch: int, k: int) -> Stats:
        z = jnp.zeros((batch,), jnp.int32)
        return cls(rounds=z, emitted=z, accepted=z, drafted=z,
                   accepted_at=jnp.zeros((batch, k), jnp.int32), oracle=z, oracle_gap=z)

    def mean_accepted(self) -> np.ndarray:
        """τ per row: tokens committed per round (accepted drafts + 1), host-side."""
        r = np.maximum(np.asarray(self.rounds), 1)
        return np.asarray(self.emitted) / r


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    """Everything a decoding round reads and writes. A pytree; donated between dispatches.

    Invariant: the target cache holds every committed token except `last`, which is the
    input of the next target forward.
    """

    cache: KVCache  # target KV cache; lengths i32[B]
    seq: jax.Array  # i32[B, C] prompt + committed tokens; seq[b, cache.lengths[b]] == last[b]
    tokens: jax.Array  # i32[B, N] generated tokens, INVALID-padded
    logprobs: jax.Array  # f32[B, N] log p of each generated token (`GenerateOutput.logprobs`)
    num_new: jax.Array  # i32[B] generated so far (including EOS)
    limit: jax.Array  # i32[B] in [1, N]: new tokens the row may emit (dynamic, <= the static N)
    stop: jax.Array  # i32[S] stop token ids (dynamic; -1 entries match nothing)
    last: jax.Array  # i32[B] last committed token, not yet in the cache
    done: jax.Array  # bool[B] row finished (EOS or its limit)
    key: jax.Array  # PRNG key
    stats: Stats
    drafter: Any = None  # drafter state pytree (None for autoregressive decoding)
    verifier: Any = None  # verifier state pytree (e.g. ASD's regret budget)
    # Per-row traced temperature / top-k / top-p (f32[B] / i32[B] fields; None: the static
    # Sampling's values). Rounds read them through `Sampling.with_rows`.
    sampling: SamplingParams | None = None
    # generate(features=): per position of `seq`, the target's RMS-normalised feature-layer
    # hidden states f32[B, C, F, D] and final-normed hidden state f32[B, C, D] of the token
    # there, written when it is fed to the target (0 until then: a row's last token never is).
    features: jax.Array | None = None
    final: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GenerateOutput:
    """What `generate` returns (a pytree: it leaves a user's jit as arrays)."""

    tokens: jax.Array  # i32[B, N] new tokens, INVALID (-1) after each row's end
    lengths: jax.Array  # i32[B] new tokens per row (EOS included when emitted)
    # f32[B, N] log p of each new token under the target's processed distribution (the one
    # sampled from: temperature, top-k, top-p; greedy: the plain softmax of the logits), read
    # from the passes that chose the token; 0 after each row's end. A policy-gradient loss
    # reads these instead of a second forward.
    logprobs: jax.Array
    stats: Stats
    verifier: Any = None  # the verifier's final state (e.g. ASD's remaining budget)
    # generate(features=...) only (else None): a drafter's training batch from the rollout.
    # sequence i32[B, W] prompt then new tokens per row (right-padded; row b's real length is
    # its prompt length + lengths[b]; W = prompt bucket + max_new_tokens), features f32[B, W,
    # F, D] the target's RMS-normalised hidden states at the F layers and final_hidden f32[B,
    # W, D] its final-normed one, at each token of `sequence` as the target was fed it (a
    # row's last token never is: 0 there and past the row's end), the layout train/featurize
    # writes.
    sequence: Any = None
    features: Any = None
    final_hidden: Any = None


def is_eos(tok: jax.Array, eos_ids: tuple[int, ...] | jax.Array) -> jax.Array:
    """bool[...]: tok i32[...] is a stop id (a static tuple, or a dynamic i32[S] array)."""
    if not isinstance(eos_ids, tuple):
        return jnp.any(tok[..., None] == eos_ids, axis=-1)
    out = jnp.zeros(tok.shape, bool)
    for e in eos_ids:
        out = out | (tok == e)
    return out


def prefill(config: ModelConfig, weights: Weights, prompt_ids: jax.Array,
            prompt_lengths: jax.Array, key: jax.Array, *, sampling: Sampling,
            max_new_tokens: int, capacity: int, eos_ids: tuple[int, ...], draft_k: int = 0,
            feature_layers: tuple[int, ...] = (), limit: jax.Array | None = None,
            stop: jax.Array | None = None, sampling_params: SamplingParams | None = None,
            keep_features: bool = False) -> tuple[SpecState, Any]:
    """Run the prompt through the target and sample the first new token.

    Args:
      prompt_ids: i32[B, P] right-padded prompts. prompt_lengths: i32[B], 1 <= len <= P.
      limit: i32[] or i32[B] new tokens per row, clipped to [1, max_new_tokens] (None: all).
      stop: i32[S] stop ids, dynamic (None: `eos_ids`, which the state then carries).
      sampling_params: per-row traced sampling values (`jspec.SamplingParams`), carried in
        the state (None: the static `sampling`'s).
      keep_features: allocate `SpecState.features` / `final` and write the prompt's
        (`feature_layers` are then the layers kept).
    Returns:
      (state, forward output of the prompt) — the latter lets drafters read target features.
    """
    b, p = prompt_ids.shape
    cache = KVCache.create(config, b, capacity)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    with jax.named_scope("prefill"):
        # The cache is empty: the prompt's attention reads its own P slots, not the capacity.
        out = forward(config, weights, prompt_ids, positions, cache, compute_logits=False,
                      hidden_layers=feature_layers, slots=p)
        last_h = jnp.take_along_axis(out.final_hidden, (prompt_lengths - 1)[:, None, None], axis=1)
        logits = lm_logits(config, weights, last_h[:, 0])  # [B, V]
    key, sub = jax.random.split(key)
    first, first_lp = sample_with_logprobs(sub, logits, sampling.with_rows(sampling_params))
    tokens = jnp.full((b, max_new_tokens), INVALID, jnp.int32).at[:, 0].set(first)
    logprobs = jnp.zeros((b, max_new_tokens), jnp.float32).at[:, 0].set(first_lp)
    lim = (jnp.full((b,), max_new_tokens, jnp.int32) if limit is None else
           jnp.clip(jnp.broadcast_to(jnp.asarray(limit, jnp.int32), (b,)), 1, max_new_tokens))
    if stop is None:
        stop = jnp.asarray(eos_ids or (INVALID,), jnp.int32)
    done = is_eos(first, stop) | (lim <= 1)
    seq = jnp.zeros((b, capacity), jnp.int32).at[:, :p].set(prompt_ids)
    seq = seq.at[jnp.arange(b), prompt_lengths].set(first)
    state = SpecState(cache=out.cache.with_lengths(prompt_lengths), seq=seq, tokens=tokens,
                      logprobs=logprobs, num_new=jnp.ones((b,), jnp.int32), limit=lim, stop=stop,
                      last=first,
                      done=done, key=key, stats=Stats.zeros(b, draft_k), sampling=sampling_params)
    if keep_features:
        real = (jnp.arange(p)[None, :] < prompt_lengths[:, None]).astype(jnp.float32)
        f = features(out.hidden) * real[..., None, None]  # [B, P, F, D]
        fin = out.final_hidden.astype(jnp.float32) * real[..., None]
        state = dataclasses.replace(
            state, features=jnp.zeros((b, capacity, *f.shape[2:]), jnp.float32).at[:, :p].set(f),
            final=jnp.zeros((b, capacity, fin.shape[-1]), jnp.float32).at[:, :p].set(fin))
    return state, out


def commit(state: SpecState, emitted: jax.Array, n_emit: jax.Array,
           eos_ids: tuple[int, ...] | jax.Array,
           cache: KVCache, n_accepted: jax.Array, n_drafted: int | jax.Array,
           oracle: jax.Array | None = None, logprobs: jax.Array | None = None,
           feats: jax.Array | None = None, final: jax.Array | None = None) -> SpecState:
    """Append up to `n_emit` tokens per live row, stop rows at EOS / their `limit`.

    Args:
      emitted: i32[B, M] this round's tokens (accepted drafts then the correction/bonus token).
      n_emit: i32[B] in [1, M] how many of them the verifier produced.
      cache: the target cache after the verify forward; its K/V for `last` and the first
        n_emit - 1 emitted tokens are valid, so committing is only a length update.
      n_accepted: i32[B] accepted drafted tokens (for statistics).
      n_drafted: i32[B] (or an int) proposed tokens put up for verification this round.
      oracle: i32[B] or None: LibraSpec's oracle length this round (statistics).
      logprobs: f32[B, M] or None: log p of each emitted token, stored beside it (None: 0).
      feats, final: f32[B, M', F, D] / f32[B, M', D] or None: the target's features of the
        tokens this round fed it (`last`, then the accepted drafts), stored at their `seq`
        positions where the state keeps features (the first `count` of them).
    """
    b, m = emitted.shape
    n_max = state.tokens.shape[1]
    live = ~state.done
    j = jnp.arange(m, dtype=jnp.int32)[None, :]
    eos = is_eos(emitted, eos_ids) & (j < n_emit[:, None])
    first_eos = jnp.min(jnp.where(eos, j, m), axis=1)
    count = jnp.minimum(jnp.minimum(n_emit, first_eos + 1), state.limit - state.num_new)
    count = jnp.where(live, count, 0)
    keep = j < count[:, None]
    rows = jnp.arange(b)[:, None]
    out_slot = jnp.where(keep, state.num_new[:, None] + j, n_max)  # n_max: dropped
    tokens = state.tokens.at[rows, out_slot].set(emitted, mode="drop")
    lp = state.logprobs
    if logprobs is not None:
        lp = lp.at[rows, out_slot].set(logprobs.astype(lp.dtype), mode="drop")
    seq_slot = jnp.where(keep, state.cache.lengths[:, None] + 1 + j, state.seq.shape[1])
    seq = state.seq.at[rows, seq_slot].set(emitted, mode="drop")
    num_new = state.num_new + count
    new_last = jnp.take_along_axis(emitted, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    hit_eos = live & (first_eos < count)
    done = state.done | hit_eos | (num_new >= state.limit)
    k = state.stats.accepted_at.shape[1]
    acc = jnp.where(live, n_accepted, 0)
    stats = Stats(rounds=state.stats.rounds + live, emitted=state.stats.emitted + count,
                  accepted=state.stats.accepted + acc,
                  drafted=state.stats.drafted + live * n_drafted,
                  accepted_at=state.stats.accepted_at
                  + (jnp.arange(k)[None, :] < acc[:, None]).astype(jnp.int32),
                  oracle=state.stats.oracle, oracle_gap=state.stats.oracle_gap)
    if oracle is not None:
        stats.oracle = stats.oracle + jnp.where(live, oracle, 0)
        stats.oracle_gap = stats.oracle_gap + jnp.where(live, jnp.abs(n_drafted - oracle), 0)
    fs, fin = state.features, state.final
    if fs is not None and feats is not None:
        jf = jnp.arange(feats.shape[1], dtype=jnp.int32)[None, :]
        f_slot = jnp.where(jf < count[:, None], state.cache.lengths[:, None] + jf, fs.shape[1])
        fs = fs.at[rows, f_slot].set(feats.astype(fs.dtype), mode="drop")
        fin = fin.at[rows, f_slot].set(final.astype(fin.dtype), mode="drop")
    return dataclasses.replace(
        state, cache=cache.with_lengths(state.cache.lengths + count), seq=seq, tokens=tokens,
        logprobs=lp, num_new=num_new, last=jnp.where(count > 0, new_last, state.last), done=done,
        stats=stats, features=fs, final=fin)


def features(hidden: jax.Array, norm: str = "rms") -> jax.Array:
    """[n, B, T, D] target hidden states -> f32[B, T, n, D], each vector divided by its RMS;
    raw (only cast) for norm "none" (a drafter's `caps.feature_norm`: imported EAGLE-3 /
    DFlash checkpoints, trained on the raw hidden states: jspec.drafters.interop)."""
    if norm == "none":
        return jnp.moveaxis(hidden.astype(jnp.float32), 0, 2)
    return jnp.moveaxis(rms_normalize(hidden), 0, 2)
