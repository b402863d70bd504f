"""The EAGLE-3 / DFlash training step compiled for a TPU slice at a real target's scale, with
abstract parameters, optimizer state and batch (nothing initialised):
`python -m train.aot --model llama-3.1-8b --topology v5e:2x4 --kind eagle3`.

What the TPU compiler says per chip: compile ok / error and time (measured here), HBM
(arguments, temporaries, outputs) against the chip.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jspec import sharding
from jspec.aot.chips import chip_of
from jspec.aot.programs import drafter_config
from jspec.aot.report import Compiled, Setup, compile_program, model_config, setup
from jspec.drafters import kinds
from jspec.drafters.trained import Frozen, split_frozen
from train.batches import batch_sharding
from train.data import Batch
from train.recipes import RECIPES
from train.update import train_step


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                        tree, shardings)


def train_step_program(s: Setup, kind: str, rows: int = 8, seq: int = 2048,
                       positions: int = 64, matmul_dtype: str = "bfloat16") -> Compiled:
    """One `train.update.train_step` (AdamW) of a `kind` drafter for the setup's target:
    `rows` sequences of `seq` tokens with their target features, `positions` chain starts /
    anchors each; parameters and moments sharded by the rules table, rows over `data`."""
    cfg = drafter_config(s.config, kind)
    mesh, d, v = s.mesh, s.config.hidden_size, s.config.vocab_size
    tx = optax.adamw(1e-4)
    full = jax.eval_shape(lambda: kinds.get(kind).init_params(cfg, jax.random.key(0)))
    params, stats = split_frozen(full)
    params = _abstract(params, sharding.params_sharding(params, mesh, head_dim=cfg.head_dim))
    opt = jax.eval_shape(tx.init, params)
    opt = _abstract(opt, sharding.params_sharding(opt, mesh, head_dim=cfg.head_dim))
    frozen = Frozen(embed=jax.ShapeDtypeStruct((v, d), jnp.float32),
                    head=jax.ShapeDtypeStruct((cfg.draft_vocab, d), jnp.float32),
                    to_draft=jax.ShapeDtypeStruct((v,), jnp.int32), stats=stats)
    frozen = _abstract(frozen, sharding.params_sharding(frozen, mesh))
    nf = len(cfg.feature_layers)
    sds = jax.ShapeDtypeStruct
    batch = Batch(tokens=sds((rows, seq), jnp.int32), lens=sds((rows,), jnp.int32),
                  plens=sds((rows,), jnp.int32), feats=sds((rows, seq, nf, d), jnp.float16),
                  final=sds((rows, seq, d), jnp.float16), pos=sds((rows, positions), jnp.int32),
                  valid=sds((rows, positions), jnp.bool_))
    batch = _abstract(batch, batch_sharding(mesh, batch))

    def step(p, o, f, b):
        return train_step(p, o, f, b, kind=kind, cfg=cfg, tx=tx, vat_head=False,
                          vat_weight=False, mesh=mesh, matmul_dtype=matmul_dtype)

    with sharding.using(mesh):
        return compile_program(f"train {kind} step", step, (params, opt, frozen, batch),
                               donate=(0, 1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m train.aot",
        description="Compile a drafter's training step for a TPU slice (libtpu; no TPU needed) "
                    "with abstract parameters and batch; print what the compiler says per chip.")
    p.add_argument("--model", default="llama-3.1-8b", help="target architecture or config.json")
    p.add_argument("--topology", default="v5e:2x4", help="TPU slice (default v5e:2x4)")
    p.add_argument("--model-parallel", type=int, default=None,
                   help="chips per tensor-parallel group (default: all)")
    p.add_argument("--kind", choices=sorted(RECIPES), default="eagle3")
    p.add_argument("--rows", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    args = p.parse_args(argv)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only
    s = setup(model_config(args.model), args.topology, 1, 128, args.model_parallel)
    c = train_step_program(s, args.kind, args.rows, args.seq)
    chip = chip_of(args.topology)
    out = {"model": args.model, "topology": args.topology, "kind": args.kind, "ok": c.ok,
           "error": c.error, "compile_s": round(c.compile_s, 1), "hbm_bytes": c.hbm_bytes,
           "fits": c.ok and c.hbm_bytes <= chip.hbm_bytes, "chip_hbm_bytes": chip.hbm_bytes}
    print(json.dumps(out))
    return 0 if c.ok else 1


if __name__ == "__main__":
    sys.exit(main())
