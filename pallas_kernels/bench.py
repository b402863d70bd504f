"""`python -m pallas_kernels.bench`: correctness of each kernel against its jnp reference, and the
time of the kernel next to the XLA path (the reference, compiled by XLA), at realistic sizes.

On an accelerator it runs the kernels compiled (interpret=False) at realistic sizes: 32 query
heads (8 KV heads), head_dim 128, bfloat16, prefixes of 4k-32k tokens, 16-64 tree nodes; a
152k vocabulary for the acceptance kernel. A kernel that fails to lower is reported as such and
the script goes on. On CPU (or with --small) it runs small sizes in interpret mode: correctness
only, since interpret-mode timings say nothing about device speed. One short script: a few
minutes on a device, well under a minute on CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.relaxed_acceptance import relaxed_acceptance, relaxed_acceptance_reference
from pallas_kernels.tree_attention import tree_attention, tree_attention_reference


def _time_ms(fn: Any, args: tuple, kwargs: dict, repeats: int) -> tuple[Any, float]:
    """(output, median ms of `repeats` calls after one warm-up call that compiles)."""
    out = jax.block_until_ready(fn(*args, **kwargs))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args, **kwargs))
        times.append(1000 * (time.perf_counter() - t0))
    return out, statistics.median(times)


def _binary_tree(t: int) -> np.ndarray:
    return np.asarray([-1] + [(i - 1) // 2 for i in range(1, t)], np.int32)


def attention_configs(small: bool) -> list[dict[str, Any]]:
    if small:
        return [dict(b=2, t=8, h=8, kv=2, hd=64, prefix=200, s=256, dtype="float32"),
                dict(b=1, t=16, h=4, kv=1, hd=128, prefix=500, s=512, dtype="bfloat16")]
    return [dict(b=1, t=t, h=32, kv=8, hd=128, prefix=p, s=p + 128, dtype="bfloat16")
            for p in (4096, 16384, 32768) for t in (16, 64)]


def acceptance_configs(small: bool) -> list[dict[str, Any]]:
    if small:
        return [dict(b=4, k=4, v=4096, temperature=1.0), dict(b=4, k=4, v=4096, temperature=0.0)]
    return [dict(b=b, k=k, v=151_936, temperature=t) for b in (1, 8) for k in (8,)
            for t in (1.0, 0.0)]


def bench_attention(cfg: dict[str, Any], interpret: bool, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    b, t, h, kv, hd, s = cfg["b"], cfg["t"], cfg["h"], cfg["kv"], cfg["hd"], cfg["s"]
    dt = jnp.dtype(cfg["dtype"])
    lengths = np.full((b,), cfg["prefix"], np.int32)
    lengths[0] = max(0, cfg["prefix"] - 37)  # ragged rows
    kc = rng.standard_normal((b, s, kv, hd), np.float32)
    vc = rng.standard_normal((b, s, kv, hd), np.float32)
    for i, n in enumerate(lengths):
        kc[i, n:] = np.nan  # junk beyond each row's length must never be read
        vc[i, n:] = np.nan
    args = (jnp.asarray(rng.standard_normal((b, t, h, hd)), dt), jnp.asarray(kc, dt),
            jnp.asarray(vc, dt), jnp.asarray(lengths),
            jnp.asarray(rng.standard_normal((b, t, kv, hd)), dt),
            jnp.asarray(rng.standard_normal((b, t, kv, hd)), dt), jnp.asarray(_binary_tree(t)))
    ref, ref_ms = _time_ms(tree_attention_reference, args, {}, repeats)
    out, ms = _time_ms(tree_attention, args, {"interpret": interpret}, repeats)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    tol = 2e-2 if dt == jnp.bfloat16 else 2e-5
    return dict(cfg, kernel_ms=ms, xla_ms=ref_ms, max_abs_err=err, ok=bool(err <= tol))


def bench_acceptance(cfg: dict[str, Any], interpret: bool, repeats: int) -> dict[str, Any]:
    b, k, v, temp = cfg["b"], cfg["k"], cfg["v"], cfg["temperature"]
    keys = jax.random.split(jax.random.key(0), 5)
    base = 2.0 * jax.random.normal(keys[0], (b, k + 1, v))
    z = base + 0.5 * jax.random.normal(keys[1], (b, k + 1, v))
    q = jax.nn.softmax(base[:, :k], axis=-1)
    x = jax.random.categorical(keys[2], base[:, :k]).astype(jnp.int32)
    u = jax.random.uniform(keys[3], (b, k))
    g = jax.random.gumbel(keys[4], (b, v))
    args = (z, x, q, None, jnp.full((b,), 0.8), u, g)
    ref, ref_ms = _time_ms(relaxed_acceptance_reference, args, {"temperature": temp}, repeats)
    out, ms = _time_ms(relaxed_acceptance, args, {"temperature": temp, "interpret": interpret},
                       repeats)
    same = bool(jnp.all(out.n_accepted == ref.n_accepted) & jnp.all(out.next_token == ref.next_token))
    err = float(jnp.max(jnp.abs(out.accept_prob - ref.accept_prob)))
    return dict(cfg, kernel_ms=ms, xla_ms=ref_ms, tokens_identical=same, max_prob_err=err,
                ok=same and err <= 1e-5)


def run(small: bool, repeats: int) -> dict[str, Any]:
    backend = jax.default_backend()
    interpret = backend == "cpu"
    small = small or interpret
    res: dict[str, Any] = {"backend": backend, "device": jax.devices()[0].device_kind,
                           "jax": jax.__version__, "interpret": interpret, "small": small,
                           "tree_attention": [], "relaxed_acceptance": []}
    for name, configs, fn in (("tree_attention", attention_configs(small), bench_attention),
                              ("relaxed_acceptance", acceptance_configs(small), bench_acceptance)):
        for cfg in configs:
            try:
                row = fn(cfg, interpret, repeats)
            except Exception as e:  # a lowering failure on this backend is a result, not a crash
                row = dict(cfg, ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            res[name].append(row)
            print(json.dumps(row), flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pallas_kernels.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true",
                   help="small sizes (automatic on CPU, where the kernels run in interpret mode)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls per measurement (median; default 5 on a device, 1 on CPU)")
    p.add_argument("--json-out", type=Path, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    repeats = args.repeats or (1 if jax.default_backend() == "cpu" else 5)
    t0 = time.perf_counter()
    res = run(args.small, repeats)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    ok = all(r["ok"] for k in ("tree_attention", "relaxed_acceptance") for r in res[k])
    mode = "interpret mode: timings are not device speed" if res["interpret"] else "compiled"
    print(f"backend {res['backend']} ({res['device']}), {mode}; all correct: {ok}; "
          f"{res['seconds']} s")
    if args.json_out:
        args.json_out.write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
