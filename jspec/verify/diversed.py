"""DIVERSED: relaxed verification against a weighted ensemble of target and drafter.

ALGORITHMS.md §3. The verifier distribution at each drafted position is
  ν_w = w·p + (1 − w)·q        (w ∈ [0, 1]: the weight on the target)
Sampling: accept x_i ~ q_i with probability min(1, ν(x_i)/q(x_i)); on rejection draw from
norm([ν − q]+) = norm([p − q]+). Each committed token is then distributed as ν, so acceptance is
1 − w·TV(p, q) and the output's distance from the target is TV(ν, p) = (1 − w)·TV(p, q).
`w = 1` is exactly lossless speculative sampling. Greedy variant: accept while x_i = argmax ν_i,
the correction token is argmax ν at the first rejection and the bonus token argmax p; p there is
softmax of the raw target logits and q the drafter's distribution (one-hot on x_i for drafters
that draft greedily without one), so w = 1 is exactly greedy.

The weight comes at three levels:
  static         `Diversed(weight=0.7)`
  task level     `Diversed(head=h)` with `h.kind == "scalar"`: one learned scalar (per task file)
  context level  `Diversed(head=h)` with `h.kind == "context"`: per drafted token,
                 w = softmax(Linear(d_draft + d_target → 2)([h_draft; h_target]))[1] on the
                 drafter's last hidden state and the target's final hidden state at the position
                 (initialised at w = 0.5). Needs a drafter with hidden states (EAGLE-3, DFlash).
Heads are trained by `python -m train diversed` and saved/loaded like drafters (safetensors).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec import safetensors_io
from jspec.errors import JspecError
from jspec.sampling import Sampling, one_hot_where_deterministic, process_logits
from jspec.verify.base import Supports, Verifier
from jspec.verify.lossless import fused_acceptance_supports, verify_chain, verify_chain_fused

HEAD_KINDS = ("scalar", "context")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DiversedHead:
    """Learned DIVERSED weight. `w` = softmax(feats @ kernel + bias)[..., 1] (target's share)."""

    kernel: jax.Array  # f32[d_draft + d_target, 2] (f32[0, 2] for kind "scalar")
    bias: jax.Array  # f32[2]
    kind: str = dataclasses.field(metadata=dict(static=True), default="context")
    d_draft: int = dataclasses.field(metadata=dict(static=True), default=0)
    d_target: int = dataclasses.field(metadata=dict(static=True), default=0)
    model: str = dataclasses.field(metadata=dict(static=True), default="")
    task: str = dataclasses.field(metadata=dict(static=True), default="")

    @classmethod
    def init(cls, kind: str, d_draft: int = 0, d_target: int = 0, model: str = "",
             task: str = "") -> DiversedHead:
        """A head at w = 0.5 everywhere (zero kernel and bias)."""
        if kind not in HEAD_KINDS:
            raise JspecError(f"DIVERSED head kind must be one of {HEAD_KINDS}, got {kind!r}")
        din = d_draft + d_target if kind == "context" else 0
        return cls(kernel=jnp.zeros((din, 2), jnp.float32), bias=jnp.zeros((2,), jnp.float32),
                   kind=kind, d_draft=d_draft if kind == "context" else 0,
                   d_target=d_target if kind == "context" else 0, model=model, task=task)

    def weight(self, feats: jax.Array | None, shape: tuple[int, ...]) -> jax.Array:
        """f32[shape]: w per position from feats f32[*shape, d_draft + d_target] (context)."""
        if self.kind == "scalar":
            return jnp.broadcast_to(jax.nn.softmax(self.bias)[1], shape)
        if feats is None:
            raise JspecError("a context-level DIVERSED head needs hidden states")
        logits = jnp.einsum("...d,dc->...c", self.normalize(feats), self.kernel) + self.bias
        return jax.nn.softmax(logits, axis=-1)[..., 1]

    def normalize(self, feats: jax.Array) -> jax.Array:
        """Each part (drafter, target) scaled to unit RMS, the whole by 1/sqrt(d_in): logits
        stay O(1) whatever the hidden states' scale, so one learning rate fits every model."""
        hd, ht = feats[..., : self.d_draft], feats[..., self.d_draft:]

        def unit(x):
            return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)

        return jnp.concatenate([unit(hd), unit(ht)], axis=-1) / np.sqrt(feats.shape[-1])

    def save(self, path: str | Path) -> None:
        meta = dict(kind=self.kind, d_draft=self.d_draft, d_target=self.d_target,
                    model=self.model, task=self.task)
        safetensors_io.write(path, {"kernel": np.asarray(self.kernel, np.float32),
                                    "bias": np.asarray(self.bias, np.float32)},
                             metadata={"jspec_diversed": json.dumps(meta)})

    @classmethod
    def load(cls, path: str | Path) -> DiversedHead:
        path = Path(path)
        shipped = Path(__file__).resolve().parent.parent / "assets" / f"{path}.safetensors"
        if not path.is_file() and path.suffix != ".safetensors" and shipped.is_file():
            path = shipped  # a shipped head by name, e.g. smollm2-135m-eagle3-diversed-math-scalar
        if not path.is_file():
            raise JspecError(f"DIVERSED head file not found: {path}")
        try:
            meta = safetensors_io.read_metadata(path).get("jspec_diversed")
            if meta is None:
                raise JspecError(f"{path} is not a DIVERSED head file")
            m = json.loads(meta)
            arrays = safetensors_io.read(path)
            kernel, bias = arrays["kernel"], arrays["bias"]
        except JspecError:
            raise
        except Exception as e:
            raise JspecError(f"cannot read DIVERSED head {path}: {e}") from e
        head = cls(kernel=jnp.asarray(kernel, jnp.float32), bias=jnp.asarray(bias, jnp.float32),
                   kind=m["kind"], d_draft=int(m["d_draft"]), d_target=int(m["d_target"]),
                   model=m.get("model", ""), task=m.get("task", ""))
        if head.kind not in HEAD_KINDS or head.bias.shape != (2,) or head.kernel.shape != (
                head.d_draft + head.d_target, 2):
            raise JspecError(f"{path}: inconsistent DIVERSED head (kind {head.kind}, kernel "
                             f"{head.kernel.shape}, bias {head.bias.shape})")
        return head

    def check(self, target_config: Any, draft_hidden: int | None) -> None:
        """Clear errors when the head does not fit this target/drafter pair."""
        if self.kind != "context":
            return
        if self.d_target != target_config.hidden_size:
            raise JspecError(f"DIVERSED head was trained for a target hidden size {self.d_target}, "
                             f"this target has {target_config.hidden_size}")
        if draft_hidden is None:
            raise JspecError("a context-level DIVERSED head needs a drafter with hidden states "
                             "(a trained EAGLE-3 or DFlash drafter)")
        if self.d_draft != draft_hidden:
            raise JspecError(f"DIVERSED head was trained for a drafter hidden size {self.d_draft}, "
                             f"this drafter has {draft_hidden}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DiversedState:
    """Per-row running measurements, plus (record=True) what training needs per token."""

    tv_sum: jax.Array  # f32[B] Σ TV(ν, p) over drafted positions that were decided by ν
    positions: jax.Array  # i32[B] how many such positions
    w_sum: jax.Array  # f32[B] Σ w over those positions
    count: jax.Array  # i32[B] tokens committed so far (index of the next token)
    p_y: jax.Array  # f32[B, N] p(y_t) of committed token t (record only; N = 0 otherwise)
    q_y: jax.Array  # f32[B, N] q(y_t)
    tv: jax.Array  # f32[B, N] TV(p, q) at token t
    relaxed: jax.Array  # bool[B, N] token t was drawn from ν (not a bonus / prefill token)
    feats: jax.Array  # f32[B, N, d_draft + d_target] head inputs at token t (context heads)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Diversed(Verifier):
    """The DIVERSED verifier. A pytree: a learned head's arrays are leaves (not baked in).

    weight: the static w (used when head is None). record: keep per-token p(y), q(y), TV and
    head inputs in the state (for `python -m train diversed`).
    """

    head: DiversedHead | None = None
    weight: float = dataclasses.field(metadata=dict(static=True), default=0.5)
    record: bool = dataclasses.field(metadata=dict(static=True), default=False)
    acceptance_impl: str = dataclasses.field(metadata=dict(static=True), default="xla")

    def __post_init__(self) -> None:
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w <= 1.0:
            raise JspecError(f"DIVERSED weight w must be in [0, 1], got {w!r}")
        if self.head is not None and not isinstance(self.head, DiversedHead):
            raise JspecError(f"head must be a DiversedHead, got {type(self.head).__name__}")
        if self.acceptance_impl not in ("xla", "pallas"):
            raise JspecError(f"acceptance_impl must be 'xla' or 'pallas', got "
                             f"{self.acceptance_impl!r}")

    @property
    def needs_hidden(self) -> bool:
        return self.head is not None and self.head.kind == "context"

    @property
    def feat_dim(self) -> int:
        return self.head.d_draft + self.head.d_target if self.needs_hidden else 0

    name = "Diversed"

    @property
    def supports(self) -> Supports:
        """Every sampling mode (greedy through the argmax-ν variant); exact only at w = 1
        without a head; a context-level head reads hidden states."""
        return Supports(exact=self.head is None and self.weight == 1.0,
                        needs_hidden=self.needs_hidden)

    def check_pair(self, target_config: Any, drafter: Any) -> None:
        """A learned head must fit the target's (and, context level, the drafter's) sizes."""
        if self.head is not None:
            self.head.check(target_config, drafter.caps.hidden_size or None)

    def init_state(self, batch: int, max_rounds: int) -> DiversedState:
        n = max_rounds if self.record else 0
        z = jnp.zeros((batch,), jnp.float32)
        return DiversedState(
            tv_sum=z, positions=jnp.zeros((batch,), jnp.int32), w_sum=z,
            count=jnp.ones((batch,), jnp.int32),  # token 0 comes from the prefill
            p_y=jnp.zeros((batch, n), jnp.float32), q_y=jnp.zeros((batch, n), jnp.float32),
            tv=jnp.zeros((batch, n), jnp.float32), relaxed=jnp.zeros((batch, n), bool),
            feats=jnp.zeros((batch, n, self.feat_dim), jnp.float32))

    def weights(self, shape: tuple[int, ...], hidden: tuple[jax.Array, jax.Array] | None
                ) -> tuple[jax.Array, jax.Array | None]:
        """(w f32[B, K], head inputs f32[B, K, Din] or None)."""
        if self.head is None:
            return jnp.full(shape, self.weight, jnp.float32), None
        feats = None
        if self.needs_hidden:
            if hidden is None:
                raise JspecError("a context-level DIVERSED head needs hidden states")
            hd, ht = hidden
            feats = jnp.concatenate([hd.astype(jnp.float32), ht.astype(jnp.float32)], axis=-1)
        return self.head.weight(feats, shape), feats

    def verify(self, vstate: DiversedState, key: jax.Array, draft: jax.Array,
               q: jax.Array | None, target_logits: jax.Array, sampling: Sampling,
               valid: jax.Array, hidden: tuple[jax.Array, jax.Array] | None = None
               ) -> tuple[jax.Array, jax.Array, DiversedState]:
        """(n_accepted i32[B], next_token i32[B], state); shapes as `verify_chain`.

        hidden: (drafter hidden f32[B, K, d_draft], target final hidden f32[B, K, d_target]) at
        the drafted positions; needed by context-level heads only.
        """
        b, k = draft.shape
        w, feats = self.weights((b, k), hidden)  # [B, K]
        if sampling.greedy:
            p = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)  # [B, K+1, V]
        else:
            p = jax.nn.softmax(process_logits(target_logits, sampling), axis=-1)
        qd = (jax.nn.one_hot(draft, p.shape[-1], dtype=jnp.float32) if q is None
              else one_hot_where_deterministic(q, draft))  # deterministic slots: one-hot
        qd = jnp.where(valid[..., None], qd, 0.0)  # an empty slot proposes nothing
        if self._fused(sampling):
            # One w per row (static or task level): the fused kernel, same random numbers.
            n, nxt = verify_chain_fused(key, draft, q, target_logits, sampling, valid, w=w[:, 0])
        else:  # the one acceptance core, with ν = w·p + (1 − w)·q
            n, nxt = verify_chain(key, draft, q, target_logits, sampling, valid, w=w)
        return n, nxt, self._update(vstate, draft, n, nxt, p, qd, w, feats, valid)

    def _fused(self, sampling: Sampling) -> bool:
        """The Pallas acceptance kernel serves sampled decoding with one w per row (static or
        scalar head) and temperature-only processing; anything else keeps the XLA path."""

        return (self.acceptance_impl == "pallas" and not self.needs_hidden
                and not sampling.greedy and fused_acceptance_supports(sampling))

    def plain_step(self, vstate: DiversedState) -> DiversedState:
        """A round with nothing drafted committed one token from p."""
        return dataclasses.replace(vstate, count=vstate.count + 1)

    def _update(self, s: DiversedState, draft: jax.Array, n: jax.Array, nxt: jax.Array,
                p: jax.Array, qd: jax.Array, w: jax.Array, feats: jax.Array | None,
                valid: jax.Array) -> DiversedState:
        b, k = draft.shape
        idx = jnp.arange(k, dtype=jnp.int32)[None]  # [1, K]
        decided = (idx <= n[:, None]) & (idx < k) & valid  # positions whose token came from ν
        tv = 0.5 * jnp.sum(jnp.abs(p[:, :k] - qd), axis=-1)  # [B, K] TV(p, q)
        slots = s.count[:, None] + idx  # token index of position i (before this round)
        s = dataclasses.replace(
            s, tv_sum=s.tv_sum + jnp.sum(jnp.where(decided, (1.0 - w) * tv, 0.0), axis=1),
            positions=s.positions + jnp.sum(decided, axis=1).astype(jnp.int32),
            w_sum=s.w_sum + jnp.sum(jnp.where(decided, w, 0.0), axis=1),
            count=s.count + n + 1)
        if not self.record:
            return s
        y = jnp.where(idx < n[:, None], draft, nxt[:, None])  # committed token at position i
        p_y = jnp.take_along_axis(p[:, :k], y[..., None], axis=-1)[..., 0]
        q_y = jnp.take_along_axis(qd, y[..., None], axis=-1)[..., 0]
        slots = jnp.where(decided, slots, s.p_y.shape[1])  # out of range: dropped
        r = jnp.arange(b)[:, None]
        s = dataclasses.replace(
            s, p_y=s.p_y.at[r, slots].set(p_y, mode="drop"),
            q_y=s.q_y.at[r, slots].set(q_y, mode="drop"),
            tv=s.tv.at[r, slots].set(tv, mode="drop"),
            relaxed=s.relaxed.at[r, slots].set(True, mode="drop"))
        if feats is not None:
            s = dataclasses.replace(s, feats=s.feats.at[r, slots].set(feats, mode="drop"))
        return s


def ensemble_logprob(head: DiversedHead | None, weight: float, p_y: jax.Array, q_y: jax.Array,
                     feats: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(log ν_w(y) f32[...], w f32[...]) of recorded tokens: the policy's log-probability."""
    w = (jnp.full(p_y.shape, weight, jnp.float32) if head is None
         else head.weight(feats, p_y.shape))
    return jnp.log(jnp.maximum(w * p_y + (1.0 - w) * q_y, 1e-30)), w
