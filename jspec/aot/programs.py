"""`jspec.generate` compiled for a TPU slice with every drafter kind, verifier and length
policy, at the target's real scale (abstract weights: nothing is initialised or loaded).

Trained drafters (EAGLE-3, DFlash) get the shapes a drafter for that target would have (one
EAGLE-3 layer of the target's width; a 2-layer DFlash block drafter; a 32k draft vocabulary);
their values do not matter to what compiles, fits and is read.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jspec
import jspec.platforms
from jspec import sharding
from jspec.aot.report import Compiled, Setup, compile_program
from jspec.drafters import dflash, eagle3
from jspec.drafters.loading import WRAPPERS
from jspec.drafters.trained import DrafterConfig
from jspec.models.config import ModelConfig
from jspec.models.model import Model

DRAFT_VOCAB = 32768


def drafter_config(cfg: ModelConfig, kind: str) -> DrafterConfig:
    """The shape of an EAGLE-3 ("eagle3") or DFlash ("dflash") drafter for target `cfg`."""
    n = cfg.num_layers
    return DrafterConfig(
        kind=kind, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, ffn_size=cfg.ffn_size,
        num_layers=1 if kind == "eagle3" else 2,
        feature_layers=tuple(sorted({min(2, n), max(n // 2, 1), max(n - 3, 1)})),
        draft_vocab=min(DRAFT_VOCAB, cfg.vocab_size), target_vocab=cfg.vocab_size,
        rope_theta=cfg.rope_theta, rms_eps=cfg.rms_eps, block=1 if kind == "eagle3" else 8,
        rope_scaling=cfg.rope_scaling)


def abstract_drafter(kind: str, s: Setup) -> Any:
    """An abstract drafter for the setup's target, laid out on its mesh: "ngram", "eagle3",
    "dflash", "early-exit" (a quarter of the target's layers), optionally with wrappers
    ("eagle3+topk:nodes=16")."""
    inner, _, wrap = kind.partition("+")
    if inner == "ngram":
        d = jspec.load_drafter("ngram", target=Model(config=s.config, weights=s.weights))
    elif inner == "early-exit":  # the target's first quarter of layers
        d = jspec.load_drafter(f"early-exit:{max(1, s.config.num_layers // 4)}",
                               target=Model(config=s.config, weights=s.weights))
    else:
        dcfg = drafter_config(s.config, inner)
        make, init = {"eagle3": (eagle3.make, eagle3.init_params),
                      "dflash": (dflash.make, dflash.init_params)}[inner]
        ids = np.arange(dcfg.draft_vocab, dtype=np.int32)
        d = jax.eval_shape(lambda w: make(dcfg, init(dcfg, jax.random.key(0)), ids, w),
                           s.weights)
    for w in [x for x in wrap.split("+") if x]:
        d = WRAPPERS.parse(w, inner=d)
    leaves_sh = sharding.params_sharding(d, s.mesh, head_dim=sharding.head_dim_of(d))
    return jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
        if isinstance(a, (jax.Array, jax.ShapeDtypeStruct)) else a, d, leaves_sh)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    drafter: str | None  # abstract_drafter kind; None: plain decoding
    temperature: float = 0.0
    k: int = 4
    verifier: Callable[[], Any] | None = None
    libraspec: bool = False


CASES = (
    Case("plain", None),
    Case("ngram chain K4 T1", "ngram", 1.0),
    Case("eagle3 chain K4 T0", "eagle3"),
    Case("eagle3 chain K4 T1", "eagle3", 1.0),
    Case("eagle3 chain K2 T1", "eagle3", 1.0, 2),  # RL rollouts at large batch (docs/RL.md)
    Case("eagle3+topk tree16 T1", "eagle3+topk:nodes=16", 1.0),
    Case("dflash K7 T0", "dflash", 0.0, 7),
    Case("dflash LibraSpec T1", "dflash", 1.0, 8, libraspec=True),
    Case("early-exit K4 T0", "early-exit"),
    Case("ngram ASD T0", "ngram", 0.0, verifier=lambda: jspec.ASD()),
)


def generate_program(s: Setup, case: Case, prompt: int = 512, new_tokens: int = 128
                     ) -> Compiled:
    """`generate` inside a jit, compiled for the setup's slice with default options."""
    mesh = s.mesh
    rows = jax.sharding.NamedSharding(mesh, sharding.logical_spec(("batch", None),
                                                                  (s.batch, prompt), mesh))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    ids = jax.ShapeDtypeStruct((s.batch, prompt), jnp.int32, sharding=rows)
    lens = jax.ShapeDtypeStruct((s.batch,), jnp.int32, sharding=jax.sharding.NamedSharding(
        mesh, sharding.logical_spec(("batch",), (s.batch,), mesh)))
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep)
    drafter = abstract_drafter(case.drafter, s) if case.drafter else None
    kw: dict[str, Any] = dict(max_new_tokens=new_tokens,
                              sampling=jspec.Sampling(temperature=case.temperature))
    if drafter is not None:
        kw["length"] = (jspec.LibraSpec(n=4, d_max=case.k) if case.libraspec
                        else jspec.FixedLength(case.k))
        if case.verifier is not None:
            kw["verifier"] = case.verifier()
    cfg = s.config

    def gen(w, d, ids, lens, key):
        return jspec.generate(Model(config=cfg, weights=w), ids, lens, drafter=d, key=key,
                              mesh=mesh, **kw).tokens

    with sharding.using(mesh):
        return compile_program(f"generate {case.name}", gen, (s.weights, drafter, ids, lens,
                                                              key))


@functools.cache
def case_names() -> tuple[str, ...]:
    return tuple(c.name for c in CASES)


def round_program(s: Setup, case: Case, prompt: int = 512, new_tokens: int = 128) -> Compiled:
    """One speculative round (`jspec.rounds.make_round`: drafting, the verify forward,
    acceptance, commit) compiled alone over an abstract decode state, for the setup's slice:
    its HBM bytes less those of the verify forward are what a round costs besides the target."""
    from jspec.rounds import init_state, make_round  # noqa: PLC0415
    from jspec.state import cache_capacity  # noqa: PLC0415

    mesh, cfg, b = s.mesh, s.config, s.batch
    drafter = abstract_drafter(case.drafter, s) if case.drafter else None
    sampling = jspec.Sampling(temperature=case.temperature)
    verifier = (case.verifier() if case.verifier else jspec.Lossless()) if drafter else None
    length = jspec.LibraSpec(n=4, d_max=case.k) if case.libraspec else None
    look = 0 if drafter is None else drafter.caps.lookahead(case.k)
    # The setup's context, as the forwards it is compared with (at least what the run needs).
    cap = max(cache_capacity(prompt, new_tokens, look, "tpu"), s.context)
    statics = dict(sampling=sampling, max_new_tokens=new_tokens, capacity=cap,
                   eos_ids=cfg.eos_ids, k=case.k if drafter else 0, verifier=verifier,
                   length=length)
    ids = jax.ShapeDtypeStruct((b, prompt), jnp.int32)
    lens = jax.ShapeDtypeStruct((b,), jnp.int32)
    with sharding.using(mesh), jspec.platforms.compiling_for("tpu"):
        state = jax.eval_shape(lambda w, d, i, n: init_state(cfg, w, d, i, n, jax.random.key(0),
                                                             **statics), s.weights, drafter,
                               ids, lens)
    state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                         state, sharding.state_sharding(state, mesh, batch=b))

    def one_round(w, d, st):
        with jspec.platforms.compiling_for("tpu"):
            return make_round(cfg, w, d, k=statics["k"], sampling=sampling, eos_ids=cfg.eos_ids,
                              verifier=verifier, length=length)(st)

    with sharding.using(mesh):
        return compile_program(f"round {case.name}", one_round, (s.weights, drafter, state),
                               donate=(2,))
