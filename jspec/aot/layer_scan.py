"""Experiment: compile time of a decode step with the layers as a `lax.scan` over stacked
[L, ...] weights and cache, against jspec's layout (per-layer buffers, layers unrolled).

`python -m jspec.aot.layer_scan --model llama-3.1-8b --topology v6e:1x1 --batch 1 --nodes 1`
prints both compile times (measured here) and HBM per chip. jspec keeps per-layer buffers
because XLA:CPU copies a stacked weight's slice before a matmul (`blocks.LayerWeights`); on TPU
the unrolled layers are what makes compiling an 8B `generate` slow (docs/TPU.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp

from jspec import platforms
from jspec.aot.report import Setup, model_config, setup, step_program
from jspec.models.blocks import Attend, embed_rows, layer, rms_norm, rope_angles
from jspec.models.llama import heads, lm_logits, pallas_platforms


def scanned_step(s: Setup, t: int) -> tuple[float, int]:
    """(compile seconds, HBM bytes per chip) of one forward of `t` tokens with the layers
    scanned (weights and cache stacked, replicated on the setup's mesh)."""
    cfg = s.config
    rep = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec())

    def stack(*xs: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype, sharding=rep)

    layers = jax.tree.map(stack, *s.weights.layers)
    k, v = stack(*s.cache.k), stack(*s.cache.v)
    rest = dataclasses.replace(s.weights, layers=())
    ids = jax.ShapeDtypeStruct((s.batch, t), jnp.int32, sharding=rep)
    lens = jax.ShapeDtypeStruct((s.batch,), jnp.int32, sharding=rep)

    def step(w, lws, ks, vs, lengths, tokens, positions):
        with platforms.compiling_for("tpu"):
            rot = rope_angles(positions, jnp.asarray(cfg.inv_freq()))
            x = embed_rows(w.embed, tokens, cfg.jnp_dtype)
            at = Attend(pallas_on=pallas_platforms(cfg, t, ks.shape[3]), mask=None,
                        lengths=lengths)

            def body(carry, xs):
                x, ks, vs = carry
                lw, i = xs
                x, ck, cv, _ = layer(heads(cfg), lw, x, rot, at, ks[i], vs[i])
                return (x, ks.at[i].set(ck), vs.at[i].set(cv)), None

            (x, ks, vs), _ = jax.lax.scan(body, (x, ks, vs), (lws, jnp.arange(cfg.num_layers)))
            return lm_logits(cfg, w, rms_norm(x, w.final_norm, cfg.rms_eps)), ks, vs

    t0 = time.perf_counter()
    c = jax.jit(step, donate_argnums=(2, 3)).lower(rest, layers, k, v, lens, ids, ids).compile()
    m = c.memory_analysis()
    hbm = (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
           - m.alias_size_in_bytes)
    return time.perf_counter() - t0, int(hbm)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jspec.aot.layer_scan", description=__doc__)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--topology", default="v6e:1x1", help="one chip: the stacked arrays are "
                   "replicated in this experiment")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--nodes", type=int, default=1, help="tokens per forward (default 1)")
    p.add_argument("--context", type=int, default=4096)
    args = p.parse_args(argv)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    s = setup(model_config(args.model), args.topology, args.batch, args.context)
    c = step_program(s, args.nodes)
    print(f"unrolled (jspec): compile {c.compile_s:.1f} s, HBM {c.hbm_bytes / 1e9:.2f} GB")
    sec, hbm = scanned_step(s, args.nodes)
    print(f"scanned layers:   compile {sec:.1f} s, HBM {hbm / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
