"""`python -m jspec aot`: a TPU report before renting a slice (compiled here, times modelled)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from jspec.errors import JspecError


def _case_names() -> tuple[str, ...]:
    from jspec.aot.programs import CASES  # noqa: PLC0415

    return tuple(c.name for c in CASES)


def _programs(flag: str, want: set[str], rep: dict, args: argparse.Namespace) -> list[dict]:
    """Compile `generate` or one round for each wanted case; a round's row says its modelled
    cost besides its verify forward (width K + 1, or the tree's nodes) as a share of an AR
    step."""
    from jspec.aot.chips import chip_of  # noqa: PLC0415
    from jspec.aot.programs import CASES, generate_program, round_program  # noqa: PLC0415
    from jspec.aot.report import model_config, setup, step_program  # noqa: PLC0415

    chip = chip_of(args.topology)
    s = setup(model_config(args.model, args.dtype), args.topology, args.batch, args.context,
              args.model_parallel, args.layers == "scanned")
    fwd = {(r["t"], r["tree"]): r for r in rep["programs"]}
    ar = fwd.get((1, False), {}).get("modelled_s")
    out = []
    for case in (c for c in CASES if c.name in want):
        make = generate_program if flag == "generate" else round_program
        c = make(s, case, args.prompt, args.new_tokens)
        print(f"  compiled {c.name}: {'ok' if c.ok else 'FAILED'} in {c.compile_s:.1f} s "
              f"({c.compile_cpu_s:.1f} s CPU)", file=sys.stderr, flush=True)
        row = dataclasses.asdict(c) | {"hbm_bytes": c.hbm_bytes}
        if flag == "rounds" and c.ok and ar and case.drafter:
            tree = "topk" in case.drafter
            width = int(case.drafter.split("nodes=")[1].split(",")[0]) if tree else case.k + 1
            if (width, tree) not in fwd:
                f = step_program(s, width, tree)
                fwd[(width, tree)] = {"modelled_s": f.modelled_s(chip) if f.ok else None}
            f_s = fwd[(width, tree)]["modelled_s"]
            row |= {"modelled_s": c.modelled_s(chip), "verify_forward_modelled_s": f_s,
                    "besides_forward_over_ar_step": (c.modelled_s(chip) - f_s) / ar
                    if f_s else None}
        out.append(row)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jspec aot",
        description="Compile a model's decode step and verify forwards for a TPU slice with the "
                    "TPU compiler (libtpu: pip install -e '.[tpu]'; no TPU needed) and abstract "
                    "weights, and report per chip: compile ok / error and time (measured here), "
                    "HBM against the chip, bytes accessed and flops, and times MODELLED with a "
                    "roofline from published chip facts (jspec/aot/chips.py).")
    p.add_argument("--model", default="llama-3.1-8b",
                   help="llama-3.1-8b (default), llama-3.1-70b, qwen3-8b, or an HF config.json "
                        "(or a directory holding one)")
    p.add_argument("--topology", default="v5e:2x4",
                   help="TPU slice, e.g. v5e:1x1, v5e:2x4 (default), v5e:4x4, v6e:1x1, v5p:2x2x2")
    p.add_argument("--model-parallel", type=int, default=None,
                   help="chips per tensor-parallel group (default: every chip of the slice)")
    p.add_argument("--batch", type=int, default=1, help="rows per step (default 1)")
    p.add_argument("--context", type=int, default=4096, help="KV-cache slots (default 4096)")
    p.add_argument("--nodes", default="1,2,4,8,16,32,64",
                   help="verify widths T = K + 1 to compile (default 1,2,4,8,16,32,64)")
    p.add_argument("--no-trees", action="store_true", help="chains only (no tree forwards)")
    p.add_argument("--tau", type=float, default=2.5,
                   help="mean tokens per round for the modelled speedup (default 2.5)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--layers", default="scanned", choices=("scanned", "unrolled"),
                   help="the target's layer layout: stacked and scanned (default; jspec's layout "
                        "for TPU, ModelConfig.scan_layers) or unrolled over per-layer buffers")
    p.add_argument("--generate", default="",
                   help="also compile jspec.generate inside a jit for these cases, comma-separated "
                        "('all' for every one): " + ", ".join(repr(n) for n in _case_names())
                        + "; with --prompt and --new-tokens")
    p.add_argument("--rounds", default="",
                   help="also compile one speculative round alone for these cases (as "
                        "--generate) and report what it costs besides its verify forward, as a "
                        "share of an autoregressive step (modelled)")
    p.add_argument("--prompt", type=int, default=512, help="prompt width for --generate (512)")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens for --generate (128)")
    p.add_argument("--json-out", type=Path, default=None, help="write the report as JSON here")
    p.add_argument("--plot", type=Path, default=None,
                   help="draw c(T) and HBM read per program here (PNG; needs matplotlib)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Compiling only: several processes may load libtpu at once (it locks a TPU host's chips).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jspec.aot.report import report, table  # noqa: PLC0415 (after the environment)

    try:
        nodes = tuple(sorted({int(x) for x in args.nodes.split(",")} | {1}))
        rep = report(args.model, args.topology, batch=args.batch, context=args.context,
                     nodes=nodes, trees=not args.no_trees, tau=args.tau,
                     model_parallel=args.model_parallel, dtype=args.dtype,
                     scan_layers=args.layers == "scanned",
                     progress=lambda c: print(f"  compiled {c.name}: "
                                              f"{'ok' if c.ok else 'FAILED'} in {c.compile_s:.1f} s",
                                              file=sys.stderr, flush=True))
    except JspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for flag in ("generate", "rounds"):
        value = getattr(args, flag)
        if not value:
            continue
        want = set(_case_names()) if value == "all" else set(value.split(","))
        unknown = want - set(_case_names())
        if unknown:
            print(f"error: unknown --{flag} cases {sorted(unknown)}", file=sys.stderr)
            return 2
        rep[flag] = _programs(flag, want, rep, args)
    print(table(rep))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(rep, indent=1))
    if args.plot:
        from jspec.plot import plot_aot  # noqa: PLC0415 (matplotlib: optional)

        print(f"wrote {plot_aot(rep, args.plot)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
