"""Prompt validation and padding: what `generate` accepts, checked before anything compiles.

Shapes are checked always; values when they are concrete (outside a user's `jit`). Prompts are
right-padded `i32[B, P]` internally; HF-style left padding / attention masks are converted.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.errors import JspecError
from jspec.models.model import Model
from jspec.state import bucket_length


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


PADDING_SIDES = ("right", "left")


def validate_prompts(model: Model, prompt_ids: Any, prompt_lengths: Any, max_new_tokens: int,
                     capacity: int | None, *, attention_mask: Any = None,
                     padding_side: str = "right") -> tuple[jax.Array, jax.Array]:
    """Check shapes always and values when concrete; return jspec's right-padded layout.

    Args:
      model: the target (its vocabulary, context length and `pad_id` are read).
      prompt_ids: i32[B, P] (or i32[P]) prompt ids, padded on `padding_side`.
      prompt_lengths: i32[B] real lengths, or None (with no `attention_mask`: all P).
      max_new_tokens: new tokens per row.
      capacity: the cache capacity asked for, or None.
      attention_mask: i32|bool[B, P] (or [P]) 1 on real tokens, an alternative to
        `prompt_lengths` (lengths are its row sums).
      padding_side: "right" (jspec's layout) or "left" (Hugging Face's: real tokens last).
    Returns:
      (ids i32[B, P] right-padded, zeros after each row's length; lengths i32[B]). Left-padded
      rows are moved to the front with a per-row gather, which also works on traced ids.
    """
    if padding_side not in PADDING_SIDES:
        raise JspecError(f"padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise JspecError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    ids = jnp.asarray(prompt_ids) if _is_concrete(prompt_ids) else prompt_ids
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise JspecError(f"prompt_ids must be int32[B, P], got shape {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise JspecError(f"prompt_ids must be integers, got {ids.dtype}")
    b, p = ids.shape
    if p == 0:
        raise JspecError("the prompt is empty")
    if attention_mask is not None and prompt_lengths is not None:
        raise JspecError("pass prompt_lengths or attention_mask, not both")
    if attention_mask is not None:
        lengths = _mask_lengths(attention_mask, b, p, padding_side)
    elif prompt_lengths is None:
        lengths = jnp.full((b,), p, jnp.int32)
    else:
        lengths = jnp.asarray(prompt_lengths, jnp.int32).reshape(-1) \
            if _is_concrete(prompt_lengths) else prompt_lengths.astype(jnp.int32).reshape(-1)
        if lengths.shape != (b,):
            raise JspecError(f"prompt_lengths must be int32[{b}], got shape {lengths.shape}")
    if _is_concrete(ids) and _is_concrete(lengths):
        ln = np.asarray(lengths)
        if (ln < 1).any():
            raise JspecError("the prompt is empty (a prompt length is < 1)")
        if (ln > p).any():
            raise JspecError(f"a prompt length exceeds the prompt width {p}")
        arr = np.asarray(ids)
        cols = np.arange(p)[None, :]
        valid = cols < ln[:, None] if padding_side == "right" else cols >= p - ln[:, None]
        bad = valid & ((arr < 0) | (arr >= model.config.vocab_size))
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise JspecError(f"token id {int(arr[r, c])} at row {r}, position {c} is outside the "
                             f"vocabulary [0, {model.config.vocab_size})")
        if model.pad_id is not None:
            if prompt_lengths is None and attention_mask is None:
                _check_unmarked_padding(arr, model.pad_id)
            else:
                _check_padding_side(arr, ln, model.pad_id, padding_side,
                                    pad_is_bos=model.pad_id == model.config.bos_id)
        longest = int(ln.max())
    else:
        longest = p
    limit = model.config.max_position
    if longest + max_new_tokens > limit:
        raise JspecError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"the model's context length {limit}")
    if capacity is not None and capacity < p + max_new_tokens + 1:
        raise JspecError(f"prompt width {p} + max_new_tokens {max_new_tokens} does not fit the "
                         f"cache capacity {capacity}")
    ids = ids.astype(jnp.int32)
    if padding_side == "left" and (prompt_lengths is not None or attention_mask is not None):
        ids = left_to_right_padded(ids, lengths)
    return ids, lengths


def _mask_lengths(attention_mask: Any, b: int, p: int, padding_side: str) -> jax.Array:
    """i32[B] row sums of an HF-style attention mask i32|bool[B, P]; when concrete, also check
    that each row's 1s are one run at the end `padding_side` does not pad."""
    mask = jnp.asarray(attention_mask) if _is_concrete(attention_mask) else attention_mask
    if mask.ndim == 1:
        mask = mask[None]
    if mask.shape != (b, p):
        raise JspecError(f"attention_mask must have the prompt_ids shape ({b}, {p}), got "
                         f"{mask.shape}")
    if not (jnp.issubdtype(mask.dtype, jnp.integer) or mask.dtype == jnp.bool_):
        raise JspecError(f"attention_mask must be integers or booleans, got {mask.dtype}")
    lengths = jnp.sum(mask != 0, axis=-1).astype(jnp.int32)
    if _is_concrete(mask):
        m = np.asarray(mask).astype(np.int64)
        if ((m != 0) & (m != 1)).any():
            raise JspecError("attention_mask must hold only 0s and 1s")
        ln = m.sum(axis=-1)
        cols = np.arange(p)[None, :]
        right = (cols < ln[:, None]).astype(np.int64)
        left = (cols >= p - ln[:, None]).astype(np.int64)
        want, mirror = (right, left) if padding_side == "right" else (left, right)
        other, where = ("left", "start") if padding_side == "right" else ("right", "end")
        for r in np.flatnonzero((m != want).any(axis=-1)):
            hint = (f"; it looks {other}-padded: pass padding_side={other!r}"
                    if (m[r] == mirror[r]).all() else "")
            raise JspecError(f"attention_mask row {r} is not one run of 1s at the {where} of "
                             f"the row, as padding_side={padding_side!r} needs{hint}")
    return lengths


def _pad_runs(arr: np.ndarray, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(leading, trailing) i64[B]: lengths of the runs of `pad_id` at each end of i32[B, P]."""
    is_pad = arr == pad_id
    lead = np.cumprod(is_pad, axis=1).sum(axis=1)
    trail = np.cumprod(is_pad[:, ::-1], axis=1).sum(axis=1)
    return lead, trail


def _check_unmarked_padding(arr: np.ndarray, pad_id: int) -> None:
    """Without lengths or a mask every position is prompt: rows of a batch that end (or start)
    in different numbers of pad tokens are almost surely a padded batch whose padding would be
    read as prompt."""
    if arr.shape[0] < 2:
        return
    lead, trail = _pad_runs(arr, pad_id)
    for name, run in (("end", trail), ("start", lead)):
        if (run != run[0]).any():
            raise JspecError(
                f"rows {name} in different numbers of pad tokens (id {pad_id}): "
                f"{run.tolist()}; without prompt_lengths every position is read as prompt. "
                "Pass prompt_lengths= or attention_mask= for a padded batch (and "
                "padding_side='left' if it is left-padded)")


def _check_padding_side(arr: np.ndarray, lengths: np.ndarray, pad_id: int,
                        padding_side: str, *, pad_is_bos: bool = False) -> None:
    """A short row whose declared-real end holds at least its padding's worth of pad tokens
    while its declared-padding end does not is padded on the other side. When the pad token is
    also BOS, a right-padded prompt's own first token is one: the start needs one more."""
    p = arr.shape[1]
    lead, trail = _pad_runs(arr, pad_id)
    n_pad = p - lengths
    real_end, pad_end = (lead, trail) if padding_side == "right" else (trail, lead)
    need = n_pad + int(pad_is_bos and padding_side == "right")
    wrong = (n_pad > 0) & (real_end >= need) & (pad_end < n_pad)
    if wrong.any():
        r = int(np.flatnonzero(wrong)[0])
        other, end = ("left", "starts") if padding_side == "right" else ("right", "ends")
        raise JspecError(
            f"row {r} ({int(lengths[r])} of {p} tokens, padding_side={padding_side!r}) {end} "
            f"with {int(n_pad[r])} pad tokens (id {pad_id}) where its prompt should be: it looks "
            f"{other}-padded; pass padding_side={other!r} (if the prompt really {end} with pad "
            "tokens, fill its padding with pad tokens too)")


def left_to_right_padded(ids: jax.Array, lengths: jax.Array) -> jax.Array:
    """i32[B, P] left-padded rows (the last `lengths` i32[B] entries real) as right-padded
    rows, zeros after each length. A per-row gather: works under jit on traced ids and lengths."""
    p = ids.shape[1]
    cols = jnp.arange(p, dtype=jnp.int32)[None, :]
    src = (cols + (p - lengths)[:, None]) % p  # each row rolled left by its padding
    return jnp.where(cols < lengths[:, None], jnp.take_along_axis(ids, src, axis=1), 0)


def pad_to_bucket(ids: jax.Array) -> jax.Array:
    """Right-pad i32[B, P] with zeros to the length bucket (a no-op under a trace)."""
    p = ids.shape[1]
    width = bucket_length(p)
    if width == p:
        return ids
    return jnp.pad(ids, ((0, 0), (0, width - p)))


def right_pad(prompts: Any, width: int | None = None, rows: int | None = None,
              pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(i32[rows, width] right-padded ids, i32[rows] lengths) from lists of token ids.

    width: default the longest prompt; rows: default len(prompts), more rows repeat the first
    prompt (a fixed batch shape for a short last batch).
    """
    width = width or max(len(p) for p in prompts)
    rows = rows or len(prompts)
    ids = np.full((rows, width), pad, np.int32)
    lens = np.ones((rows,), np.int32)
    for r in range(rows):
        p = prompts[r] if r < len(prompts) else prompts[0]
        ids[r, :len(p)] = p
        lens[r] = len(p)
    return ids, lens



def bucket_prompts(prompts: Any, rows: int | None = None, pad: int = 0
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(i32[rows, W] right-padded ids, i32[rows] lengths) with W the length bucket of the
    longest prompt (`jspec.state.bucket_length`): host-side padding for callers whose own
    `jit` takes the ids, so that their prompt widths (and compiles) stay few. Inside a trace
    `generate` cannot bucket for them: the width is the traced array's.

    Args:
      prompts: a list of token-id lists.
      rows: the batch (default len(prompts); more rows repeat the first prompt, so a short
        last batch keeps the shape).
      pad: the padding id.
    """
    return right_pad(prompts, bucket_length(max(len(p) for p in prompts)), rows, pad)
