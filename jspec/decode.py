"""`generate` and `stream`: validation, placement and the jitted entry points.

Static (changing these recompiles): the model config, `Sampling`, drafter/verifier/length
objects, `max_new_tokens`, the prompt-length bucket, the cache capacity and the mesh.
Dynamic: weights, prompt ids and lengths, the PRNG key, the per-row `limit` of new tokens,
`stop_ids`, per-row `sampling_params` (temperature / top-k / top-p values; the static
`Sampling` keeps greedy-vs-sampled and top-k's bound).
Under a mesh (`jspec.sharding`), inputs are placed and the carried state is pinned to the
rules-table layout; the round functions themselves are the single-device code
(`jspec.rounds`), over the state of `jspec.state`.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
from jax.sharding import Mesh

from jspec import memory, platforms, sharding
from jspec.drafters.base import Drafter, settings_of
from jspec.drafters.bind import share_target
from jspec.errors import JspecError, PlainDecodingWarning
from jspec.generate_args import (
    check_mesh_argument,
    feature_layers,
    in_user_trace,
    limit_rows,
    sampling_rows,
    stop_array,
)
from jspec.inputs import pad_to_bucket, validate_prompts
from jspec.length import FixedLength, LibraSpec
from jspec.models.config import ModelConfig
from jspec.models.llama import Weights
from jspec.models.model import Model
from jspec.rounds import LengthPolicy, init_state, make_round, run_rounds
from jspec.sampling import Sampling, SamplingParams
from jspec.state import GenerateOutput, SpecState, cache_capacity
from jspec.verify import Lossless
from jspec.verify.base import Verifier, check_verifier

# The verifier is a pytree argument (a learned DIVERSED head's arrays are leaves); Lossless and
# ASD are registered static pytrees, so their settings still key the compilation cache.
_STATIC = ("config", "sampling", "max_new_tokens", "capacity", "eos_ids", "k", "length",
           "mesh", "platform", "features")


def _pin_inputs(mesh: Mesh | None, config: ModelConfig, weights: Weights, drafter: Any,
                verifier: Any, prompt_ids: jax.Array, prompt_lengths: jax.Array
                ) -> tuple[Any, ...]:
    """Under a mesh, constrain weights / drafter / verifier / prompts to their rule-table
    shardings (a verifier's arrays, e.g. a DIVERSED head, are replicated)."""
    if mesh is None:
        return weights, drafter, verifier, prompt_ids, prompt_lengths
    weights = sharding.constrain(weights, sharding.params_sharding(weights, mesh,
                                                                   head_dim=config.head_dim))
    if jax.tree.leaves(drafter):
        drafter = sharding.constrain(drafter, sharding.params_sharding(
            drafter, mesh, head_dim=sharding.head_dim_of(drafter)))
    if jax.tree.leaves(verifier):
        verifier = sharding.constrain(verifier, sharding.replicated(verifier, mesh))
    b = prompt_ids.shape[0]
    prompt_ids, prompt_lengths = sharding.constrain(
        (prompt_ids, prompt_lengths),
        sharding.state_sharding((prompt_ids, prompt_lengths), mesh, batch=b))
    return weights, drafter, verifier, prompt_ids, prompt_lengths


def _pin_state(mesh: Mesh | None, state: SpecState) -> SpecState:
    """Under a mesh, keep the carried state in its rule-table layout (batch rows over `data`,
    cache KV heads over `model`) from round to round."""
    if mesh is None:
        return state
    return sharding.constrain(state, sharding.state_sharding(state, mesh,
                                                             batch=state.last.shape[0]))


def _pinned_round(mesh: Mesh | None, round_fn: Any) -> Any:
    if mesh is None:
        return round_fn
    return lambda s: _pin_state(mesh, round_fn(s))


@functools.partial(jax.jit, static_argnames=_STATIC)
def _generate(weights: Weights, drafter: Any, verifier: Any, prompt_ids: jax.Array,
              prompt_lengths: jax.Array, key: jax.Array, limit: jax.Array | None = None,
              stop: jax.Array | None = None, params: SamplingParams | None = None, *,
              config: ModelConfig,
              sampling: Sampling, max_new_tokens: int, capacity: int,
              eos_ids: tuple[int, ...], k: int, length: Any = None,
              mesh: Mesh | None = None, platform: str | None = None,
              features: tuple[int, ...] = ()) -> GenerateOutput:
    drafter = share_target(drafter, weights)
    with platforms.compiling_for(platform):
        return _generate_body(weights, drafter, verifier, prompt_ids, prompt_lengths, key,
                              limit, stop, params, config=config, sampling=sampling,
                              max_new_tokens=max_new_tokens, capacity=capacity, eos_ids=eos_ids,
                              k=k, length=length, mesh=mesh, features=features)


def _generate_body(weights: Weights, drafter: Any, verifier: Any, prompt_ids: jax.Array,
                   prompt_lengths: jax.Array, key: jax.Array, limit: jax.Array | None,
                   stop: jax.Array | None, params: SamplingParams | None, *, config: ModelConfig,
                   sampling: Sampling, max_new_tokens: int, capacity: int,
                   eos_ids: tuple[int, ...], k: int, length: Any = None,
                   mesh: Mesh | None = None, features: tuple[int, ...] = ()) -> GenerateOutput:
    weights, drafter, verifier, prompt_ids, prompt_lengths = _pin_inputs(
        mesh, config, weights, drafter, verifier, prompt_ids, prompt_lengths)
    state = init_state(config, weights, drafter, prompt_ids, prompt_lengths, key,
                       sampling=sampling, max_new_tokens=max_new_tokens, capacity=capacity,
                       eos_ids=eos_ids, k=k, verifier=verifier, length=length, limit=limit,
                       stop=stop, sampling_params=params, features=features)
    state = _pin_state(mesh, state)
    round_fn = make_round(config, weights, drafter, k=k, sampling=sampling, eos_ids=eos_ids,
                          verifier=verifier, length=length, features=features)
    state = run_rounds(_pinned_round(mesh, round_fn), state, max_new_tokens - 1)
    out = GenerateOutput(tokens=state.tokens, lengths=state.num_new, logprobs=state.logprobs,
                         stats=state.stats, verifier=state.verifier)
    if features:
        w = prompt_ids.shape[1] + max_new_tokens
        out = dataclasses.replace(out, sequence=state.seq[:, :w], features=state.features[:, :w],
                                  final_hidden=state.final[:, :w])
    return out


@functools.partial(jax.jit, static_argnames=_STATIC)
def _init_jit(weights: Weights, drafter: Any, verifier: Any, prompt_ids: jax.Array,
              prompt_lengths: jax.Array, key: jax.Array,
              params: SamplingParams | None = None, **statics: Any) -> SpecState:
    mesh = statics.pop("mesh", None)
    platform = statics.pop("platform", None)
    drafter = share_target(drafter, weights)
    weights, drafter, verifier, prompt_ids, prompt_lengths = _pin_inputs(
        mesh, statics["config"], weights, drafter, verifier, prompt_ids, prompt_lengths)
    with platforms.compiling_for(platform):
        state = init_state(statics["config"], weights, drafter, prompt_ids, prompt_lengths, key,
                           verifier=verifier, sampling_params=params,
                           **{k: v for k, v in statics.items() if k != "config"})
    return _pin_state(mesh, state)


@functools.partial(jax.jit, static_argnames=("config", "sampling", "eos_ids", "k", "length",
                                             "rounds", "mesh", "platform"),
                   donate_argnames=("state",))
def _chunk_jit(weights: Weights, drafter: Any, verifier: Any, state: SpecState, *,
               config: ModelConfig, sampling: Sampling, eos_ids: tuple[int, ...], k: int,
               rounds: int, length: Any = None, mesh: Mesh | None = None,
               platform: str | None = None) -> SpecState:
    drafter = share_target(drafter, weights)
    with platforms.compiling_for(platform):
        round_fn = make_round(config, weights, drafter, k=k, sampling=sampling,
                              eos_ids=eos_ids, verifier=verifier, length=length)
        return run_rounds(_pinned_round(mesh, round_fn), state, rounds)


def generate(model: Model, prompt_ids: Any, prompt_lengths: Any = None, *,
             attention_mask: Any = None, padding_side: str = "right",
             drafter: Drafter | None = None, max_new_tokens: int = 128,
             sampling: Sampling = Sampling(), verifier: Verifier | None = None,
             length: LengthPolicy | None = None, key: jax.Array | None = None,
             capacity: int | None = None, limit: Any = None, stop_ids: Any = None,
             sampling_params: SamplingParams | None = None, features: Any = False,
             attention_impl: str | None = None, mesh: Mesh | bool | None = None
             ) -> GenerateOutput:
    """Generate up to `max_new_tokens` tokens per prompt; works inside a user's `jax.jit`.

    Args:
      model: the target model.
      prompt_ids: i32[B, P] prompt token ids padded on `padding_side` (or i32[P] for one
        prompt).
      prompt_lengths: i32[B] real lengths (default: all P; concrete ids of a batch whose rows
        end or start in different numbers of `model.pad_id` tokens are then refused).
      attention_mask: i32|bool[B, P], Hugging Face style (1 on real tokens): an alternative to
        `prompt_lengths` (lengths are its row sums; when concrete, it must be one run of 1s on
        the side `padding_side` does not pad).
      padding_side: "right" (default: real tokens first) or "left" (Hugging Face batches: real
        tokens last; rows are moved to the right-padded layout with a per-row gather, also
        under jit).
      drafter: None for plain autoregressive decoding. Given no `length=` and Lossless
        verification, a batch larger than the drafter's measured `max_batch` (the point past
        which speculation stops paying, `jspec.defaults`) is decoded plainly, with a
        `PlainDecodingWarning`: the same output distribution, greedy the same tokens; pass
        `length=` to speculate regardless. Inside a user's jit that switch is an error
        instead (choose: `length=` to speculate, or drafter=None).
      max_new_tokens: static maximum of new tokens per row (the output's width).
      limit: dynamic new tokens per row, an int or i32[] / i32[B] array clipped to [1,
        max_new_tokens] (default: max_new_tokens): a loop varies it without a recompile.
      stop_ids: dynamic stop token ids i32[S] replacing `model.eos_ids` (a row ends after
        emitting one); other values of the same S compile nothing (pad with -1).
      sampling: `Sampling(temperature, top_k, top_p)`, static; temperature 0 is greedy.
      sampling_params: `jspec.SamplingParams(temperature=, top_k=, top_p=)`, dynamic per-row
        values (scalars or [B] arrays; a field left None keeps `sampling`'s): other values
        compile nothing. `sampling` still decides the program: temperature > 0 for the
        sampled one (a row at temperature 0 is then greedy), top_k > 0 as the bound of a
        traced top_k. Lossless verification then takes the xla acceptance path.
      features: static; True (the drafter's `caps.feature_layers`) or a tuple of target layer
        indices (plain decoding, or a drafter without feature layers): also return the
        rollout as a drafter's training batch, `sequence`, `features` and `final_hidden`
        (`GenerateOutput`), read from the passes that already ran.
      key: PRNG key for sampling; required when sampling (temperature > 0: a missing key is
        an error, so that a loop never reuses one silently); unused when greedy.
      capacity: static KV-cache slots (default: prompt bucket + max_new_tokens, rounded up).
      attention_impl: "auto" | "xla" | "pallas": overrides `model.config.attention_impl` for the
        target's forward passes (a drafter keeps its own config).
      mesh: static; run sharded on this `jax.sharding.Mesh` (axes "data" and "model", see
        `jspec.sharding`); weights, drafter, prompts and the decode state are laid out by
        `jspec.sharding.RULES`. Default (None), called eagerly: the mesh set with
        `jax.set_mesh`, if any, else one device. Inside a user's jit jspec sees only the
        abstract context mesh, so there None under a `jax.set_mesh` context is an error: pass
        the Mesh, or mesh=False to pin nothing (XLA propagates your inputs' shardings).
    Returns:
      GenerateOutput: tokens i32[B, max_new_tokens] (-1 after each row's end), lengths i32[B],
      logprobs f32[B, max_new_tokens] (log p of each token under the processed target
      distribution; 0 after each row's end), stats; with `features`, sequence / features /
      final_hidden. Under a mesh, arrays are sharded over `data` by row.
    """
    # _prepare directly (not through `_arguments`): its PlainDecodingWarning names the caller.
    statics, args = _prepare(model, prompt_ids, prompt_lengths, attention_mask, padding_side,
                             drafter, max_new_tokens, sampling, verifier, length, key, capacity,
                             attention_impl, mesh, features)
    args = _with_dynamic(statics, args, limit, stop_ids, sampling_params)
    with sharding.using(statics["mesh"]):
        if statics["mesh"] is None and not isinstance(args[3], jax.core.Tracer):
            _check_memory(*args[:6], statics)
        return _generate(*args, **statics)


def lower(model: Model, prompt_ids: Any, prompt_lengths: Any = None, **kw: Any
          ) -> jax.stages.Lowered:
    """`generate`'s program for these inputs, lowered and not run (keyword arguments as
    `generate`'s; the same validation, plain-decoding choice and static arguments):
    `.compile()` it for `memory_analysis()` / `cost_analysis()`, `.as_text()` for its HLO.

    Args:
      model, prompt_ids (i32[B, P]), prompt_lengths (i32[B]), **kw: as `generate`.
    Returns:
      jax.stages.Lowered: the jitted `generate` program lowered for these arguments.
    """
    statics, args = _arguments(model, prompt_ids, prompt_lengths, **kw)
    with sharding.using(statics["mesh"]):
        return _generate.lower(*args, **statics)


def _arguments(model: Model, prompt_ids: Any, prompt_lengths: Any = None, *,
               attention_mask: Any = None, padding_side: str = "right",
               drafter: Drafter | None = None, max_new_tokens: int = 128,
               sampling: Sampling = Sampling(), verifier: Verifier | None = None,
               length: LengthPolicy | None = None, key: jax.Array | None = None,
               capacity: int | None = None, limit: Any = None, stop_ids: Any = None,
               sampling_params: SamplingParams | None = None, features: Any = False,
               attention_impl: str | None = None, mesh: Mesh | bool | None = None
               ) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """(the statics, the positional arguments) of `_generate` for a `generate` call: (weights,
    drafter, verifier, ids, lengths, key, limit, stop, params)."""
    statics, args = _prepare(model, prompt_ids, prompt_lengths, attention_mask, padding_side,
                             drafter, max_new_tokens, sampling, verifier, length, key, capacity,
                             attention_impl, mesh, features)
    return statics, _with_dynamic(statics, args, limit, stop_ids, sampling_params)


def _with_dynamic(statics: dict[str, Any], args: tuple[Any, ...], limit: Any, stop_ids: Any,
                  sampling_params: SamplingParams | None) -> tuple[Any, ...]:
    """`_prepare`'s (weights, drafter, verifier, ids, lengths, key) + (limit, stop, params)."""
    b = args[3].shape[0]
    return (*args, limit_rows(limit, b), stop_array(stop_ids),
            sampling_rows(sampling_params, statics["sampling"], b))


def _prepare(model: Model, prompt_ids: Any, prompt_lengths: Any, attention_mask: Any,
             padding_side: str, drafter: Any, max_new_tokens: int, sampling: Sampling,
             verifier: Any, length: Any, key: jax.Array | None, capacity: int | None,
             attention_impl: str | None, mesh: Mesh | bool | None, features: Any = False
             ) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """What `generate` and `stream` share: validate the inputs, choose plain decoding where it
    is faster, fix the static arguments, place the inputs on the mesh. Returns the statics and
    (weights, drafter, verifier, ids, lengths, key)."""
    if not isinstance(sampling, Sampling) or sampling.rows is not None:
        raise JspecError("sampling must be a jspec.Sampling (per-row values go to "
                         f"sampling_params=), got {sampling!r}")
    if attention_impl is not None:
        model = model.with_attention_impl(attention_impl)
    ids, lengths = validate_prompts(model, prompt_ids, prompt_lengths, max_new_tokens, capacity,
                                    attention_mask=attention_mask, padding_side=padding_side)
    ids = pad_to_bucket(ids)
    traced = in_user_trace()
    check_mesh_argument(mesh, traced)
    layers = feature_layers(features, drafter, model.config)
    if plain_is_faster(drafter, length, verifier, ids.shape[0]):
        limit = settings_of(drafter).max_batch
        where = "at every batch size" if limit == 0 else f"past batch {limit}"
        if traced:
            raise JspecError(
                f"inside your jit, batch {ids.shape[0]} is {where} where this drafter's "
                f"measured record says plain decoding is faster (max_batch = {limit}); "
                f"jspec does not switch a traced program silently: pass "
                f"length=jspec.FixedLength(k) to speculate, or drafter=None to decode plainly")
        warnings.warn(PlainDecodingWarning(
            f"decoding plainly: this drafter's measured record says plain decoding is faster "
            f"{where} on this machine class (max_batch = {limit}; batch {ids.shape[0]}); "
            f"the output distribution is the same. Pass length=jspec.FixedLength(k) to "
            f"speculate anyway, or re-measure with `python -m jspec calibrate`."), stacklevel=3)
        drafter, verifier = None, None
    statics = _statics(model, ids, drafter, sampling, max_new_tokens, verifier, length, capacity,
                       mesh)
    statics["features"] = layers
    if key is None:
        if not sampling.greedy:
            raise JspecError(f"sampling at temperature {sampling.temperature} needs a PRNG key: "
                             "pass key=jax.random.key(seed) (in a loop, a new key each step, "
                             "e.g. jax.random.fold_in(key, step))")
        key = jax.random.key(0)  # greedy decoding draws nothing
    verifier = statics.pop("verifier")
    with sharding.using(statics["mesh"]):
        args = _place_inputs(statics["mesh"], model, drafter, verifier, ids, lengths, key)
    return statics, args


def plain_is_faster(drafter: Any, length: Any, verifier: Any, batch: int) -> bool:
    """No `length=` asked for, a batch past the drafter's measured `max_batch` (None: no
    limit; 0: every batch), lossless verification: plain decoding is the faster way to the same
    distribution."""
    if drafter is None or length is not None or not isinstance(drafter, Drafter):
        return False
    limit = settings_of(drafter).max_batch
    return limit is not None and batch > limit and (verifier is None or isinstance(verifier, Lossless))


def _check_memory(weights: Weights, drafter: Any, verifier: Any, ids: jax.Array,
                  lengths: jax.Array, key: jax.Array, statics: dict[str, Any]) -> None:
    """A batch that cannot fit is a clear error before it runs (`jspec.memory`; one device)."""
    b = ids.shape[0]
    est = memory.estimate_bytes(statics["config"], b, statics["capacity"], statics["k"],
                                ids.shape[1], drafter)
    resident = sum(a.nbytes for a in jax.tree.leaves((weights, drafter, verifier))
                   if hasattr(a, "nbytes"))
    memory.check_fits(lambda: _generate.lower(weights, drafter, verifier, ids, lengths, key,
                                              **statics), b, est, memory.free_bytes(), resident)


def _place_inputs(mesh: Mesh | None, model: Model, drafter: Any, verifier: Any, ids: jax.Array,
                  lengths: jax.Array, key: jax.Array) -> tuple[Any, ...]:
    """Transfer the inputs to their mesh layout once, before the jitted call (a no-op for
    arrays already placed, e.g. with `jspec.sharding.shard_model`)."""
    if mesh is None:
        return model.weights, drafter, verifier, ids, lengths, key
    weights = sharding.shard_model(model, mesh).weights
    drafter = sharding.shard_drafter(drafter, mesh)
    verifier = sharding.place(verifier, sharding.replicated(verifier, mesh))
    ids, lengths, key = sharding.place((ids, lengths, key), sharding.state_sharding(
        (ids, lengths, key), mesh, batch=ids.shape[0]))
    return weights, drafter, verifier, ids, lengths, key


def _statics(model: Model, ids: jax.Array, drafter: Any, sampling: Sampling, max_new_tokens: int,
             verifier: Any, length: Any, capacity: int | None, mesh: Mesh | bool | None = None
             ) -> dict[str, Any]:

    k = 0
    if drafter is not None:
        if not isinstance(drafter, Drafter):
            raise JspecError(f"drafter must implement jspec.drafters.base.Drafter (caps, "
                             f"init_state, draft, observe), got {type(drafter).__name__}")
        length = FixedLength(settings_of(drafter).k) if length is None else length
        verifier = Lossless() if verifier is None else verifier
        if not isinstance(length, (FixedLength, LibraSpec)):
            raise JspecError("length must be a jspec.FixedLength or jspec.LibraSpec, got "
                             f"{type(length).__name__}")
        if isinstance(length, LibraSpec):
            _check_libraspec(length, drafter)
        caps = drafter.caps
        check_verifier(verifier, sampling, target_config=model.config, drafter=drafter,
                       dynamic_length=isinstance(length, LibraSpec), tree=caps.tree)
        k = length.max_k
    elif verifier is not None or length is not None:
        raise JspecError("verifier= and length= need a drafter")
    # Slots a round writes beyond `last`: k, or a tree drafter's T - 1 nodes.
    look = 0 if drafter is None else drafter.caps.lookahead(k)
    mesh = None if mesh is False else sharding.resolve_mesh(mesh)
    platform = target_platform(mesh, model.weights, ids)
    cap = capacity or cache_capacity(ids.shape[1], max_new_tokens, look, platform)
    if cap < ids.shape[1] + max_new_tokens + look + 1:
        raise JspecError(f"prompt width {ids.shape[1]} + max_new_tokens {max_new_tokens} + a "
                         f"verify block of {look + 1} does not fit the cache capacity {cap}")
    return dict(config=model.config, sampling=sampling, max_new_tokens=max_new_tokens,
                capacity=cap, eos_ids=model.eos_ids, k=k, verifier=verifier,
                length=None if type(length) is FixedLength else length,  # k says it
                mesh=mesh, platform=platform)


def target_platform(mesh: Mesh | None, *inputs: Any) -> str | None:
    """The platform `generate`'s program is compiled for, when known before tracing: the mesh's
    devices, else the concrete inputs' devices, else the context's abstract mesh; None inside a
    user's jit with none of these (then each backend-specific choice is made when the program
    is lowered, `jspec.platforms.choose`)."""
    return (platforms.of_mesh(mesh) or platforms.of_arrays(inputs)
            or platforms.of_mesh(jax.sharding.get_abstract_mesh()))


def _check_libraspec(policy: Any, drafter: Any) -> None:

    if drafter.caps.block_tokens <= 0 or drafter.caps.tree:
        raise JspecError(f"LibraSpec needs a block drafter with confidences that can draft more "
                         f"blocks (DFlash); {getattr(drafter, 'name', type(drafter).__name__)!r} "
                         "cannot")


def stream(model: Model, prompt_ids: Any, prompt_lengths: Any = None, *,
           attention_mask: Any = None, padding_side: str = "right",
           drafter: Drafter | None = None, max_new_tokens: int = 128,
           sampling: Sampling = Sampling(), verifier: Verifier | None = None,
           length: LengthPolicy | None = None, key: jax.Array | None = None,
           sampling_params: SamplingParams | None = None, rounds_per_dispatch: int = 8,
           attention_impl: str | None = None, mesh: Mesh | bool | None = None):
    """Yield (tokens i32[B, N], num_new i32[B], stats, all_done) after each dispatch.

    The same rounds as `generate`, `rounds_per_dispatch` of them per device dispatch; the host
    reads the state once per dispatch (not per token), which lets a terminal show text as it
    is produced. `attention_mask`, `padding_side`, `key` (required when sampling),
    `sampling_params`, `attention_impl` and `mesh` as in `generate`.
    """
    statics, (weights, drafter, verifier, ids, lengths, key) = _prepare(
        model, prompt_ids, prompt_lengths, attention_mask, padding_side, drafter, max_new_tokens,
        sampling, verifier, length, key, None, attention_impl, mesh)
    mesh = statics["mesh"]
    with sharding.using(mesh):
        state = _init_jit(weights, drafter, verifier, ids, lengths, key,
                          sampling_rows(sampling_params, sampling, ids.shape[0]), **statics)
    loop_statics = {k: statics[k] for k in ("config", "sampling", "eos_ids", "k", "length",
                                            "mesh", "platform")}
    while True:
        tokens, num_new, done, st = jax.device_get(
            (state.tokens, state.num_new, state.done, state.stats))
        yield tokens, num_new, st, bool(done.all())
        if done.all():
            return
        with sharding.using(mesh):
            state = _chunk_jit(weights, drafter, verifier, state, rounds=rounds_per_dispatch,
                               **loop_statics)
