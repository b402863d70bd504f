"""Argument groups of `python -m jspec` (jspec/cli.py) shared by its subcommands, and the
`bench` subcommand's parser."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_impl_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attention-impl", choices=("auto", "xla", "pallas"), default="auto",
                   help="target attention: auto (default: the Pallas kernel on TPU, and on GPU "
                        "where the Mosaic GPU kernel applies; XLA on CPU; decided by the devices "
                        "the program is compiled for), xla, or pallas "
                        "(pallas_kernels.tree_attention; interpret mode on CPU: correct, slow)")
    p.add_argument("--acceptance-impl", choices=("xla", "pallas"), default="xla",
                   help="lossless verifier's acceptance: xla (default) or pallas (the fused "
                        "pallas_kernels.relaxed_acceptance kernel; temperature only, top-k/top-p "
                        "use xla; interpret mode on CPU)")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """`python -m jspec bench` (run by jspec.bench.main)."""
    b = sub.add_parser("bench", help="benchmarks (see docs/BENCHMARKS.md)",
                       description="Measure decoding speed; every ratio is measured in one run.")
    b.add_argument("--model", default="smollm2-135m", help="target model (default smollm2-135m)")
    b.add_argument("--baseline", action="store_true",
                   help="autoregressive tokens/s (float32, bfloat16), the verification cost curve "
                        "c(K), and HF transformers on the same weights when torch is installed")
    b.add_argument("--new-tokens", type=int, default=128, help="tokens generated per measurement")
    b.add_argument("--repeats", type=int, default=3,
                   help="timed repeats (median reported); within one, each prompt is decoded by "
                        "every configuration back to back, the order rotating per prompt")
    b.add_argument("--fill", type=int, default=400, help="cache fill for the c(K) curve")
    b.add_argument("--no-peer", action="store_true", help="skip HF transformers even if installed")
    b.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 rows")
    b.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="target dtype of the speculative rows (default float32); with bfloat16 "
                        "a float32 autoregressive row is added, and 'vs best AR' is the speedup "
                        "over the faster of the two autoregressive rows")
    b.add_argument("--drafters", default="",
                   help="comma-separated drafters for speculative rows, e.g. "
                   "ngram,smollm2-135m-eagle3@4/6,smollm2-135m-dflash@7 (@K1/K2: that "
                   "drafter's own lengths instead of --ks)")
    b.add_argument("--ks", default="2,4,8", help="comma-separated speculation lengths K")
    b.add_argument("--lengths", default="",
                   help="semicolon-separated dynamic length policies run (lossless) for every "
                        "block drafter in --drafters, e.g. 'libraspec;libraspec:n=4,alpha=0.8' "
                        "(table columns: mean d = proposed tokens verified per round, |d-oracle| "
                        "= mean distance from the longest prefix that would have been accepted)")
    b.add_argument("--temperatures", default="0,1", help="comma-separated temperatures")
    b.add_argument("--verifiers", default="lossless",
                   help="semicolon-separated verifiers, e.g. 'lossless;asd:budget=8,gate=0.25,cap=2;"
                        "diversed:w=0.7' (ASD runs at T=0 only)")
    b.add_argument("--quality", action="store_true",
                   help="quality columns: target NLL per generated token, task score (HumanEval "
                        "pass@1 with unit tests run sandboxed, 5 s timeout; exact answer for "
                        "math sets) and, at T=0, outputs changed vs autoregressive greedy")
    b.add_argument("--prompts", default="humaneval:8",
                   help="prompt set and range, e.g. humaneval:8 or humaneval:100-164; several "
                        "joined by commas (e.g. humaneval:0-8,gsm8k:0-8,mtbench:60-68) run together, with "
                        "a second table by set")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--batch-sizes", default="",
                   help="comma-separated batch sizes, e.g. 1,4,16,64: batched greedy generation "
                        "of the same prompts (--prompts, default alpaca:0-64) in batches of each "
                        "size, jspec float32/bfloat16 next to HF transformers (when torch is "
                        "installed), with jspec's planned peak memory; --drafters then adds "
                        "speculative rows at every batch size (name@K, --dtype target) instead "
                        "of the batch-1 table")
    b.add_argument("--json-out", type=Path, help="also write the results as JSON to this file")
    b.add_argument("--plot", type=Path, metavar="OUT.png",
                   help="also draw the results (acceptance by position, speedup and tau "
                        "against K, c(K)); needs matplotlib (the plot extra)")
    add_impl_args(b)
