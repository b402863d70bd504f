"""The command lines of `python -m train eagle3 | dflash` (what they do: `train.drafters`)."""

from __future__ import annotations

from typing import Any

from train import drafters
from train.drafters import run
from train.recipes import DEFAULT_DRAFT_VOCAB, RECIPES


def add_parsers(sub: Any) -> None:
    for kind, help_ in (("eagle3", "train an EAGLE-3 drafter (one layer, training-time test)"),
                        ("dflash", "train a DFlash block-diffusion drafter")):
        p = sub.add_parser(kind, help=help_, description=help_ + ". " + drafters.__doc__.split("\n")[2])
        p.set_defaults(func=run, kind=kind)
        p.add_argument("--data", default="runs/data", help="datagen shard directory")
        p.add_argument("--out", default=f"runs/{kind}",
                       help="run directory: checkpoints, log.jsonl, vocab.npy, the drafter file")
        p.add_argument("--name", default="", help="drafter file name (default: the kind)")
        p.add_argument("--model", default="smollm2-135m", help="target model")
        p.add_argument("--sets", nargs="*", default=None,
                       help="prompt sets to train on (default: every set in --data)")
        p.add_argument("--steps", type=int, default=300, help="optimizer steps")
        p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
        p.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
        p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
        p.add_argument("--weight-decay", type=float, default=0.01)
        p.add_argument("--batch-tokens", type=int, default=4096,
                       help="tokens per batch (rows x sequence bucket)")
        p.add_argument("--seq-buckets", type=int, nargs="+", default=[256, 512],
                       help="padded sequence lengths (longer rows keep their last tokens)")
        p.add_argument("--draft-vocab", type=int, default=None,
                       help="draft vocabulary: the most frequent response tokens (default "
                            f"{DEFAULT_DRAFT_VOCAB}; with --init the file's, and a larger N grows "
                            "it: its tokens stay, the next most frequent are added)")
        p.add_argument("--ffn", type=int, default=None,
                       help=f"drafter MLP width (default {RECIPES[kind].ffn}; with --init the "
                            "file's, and a larger N grows it: the new units start with zero "
                            "output weights, so the grown drafter starts as the file's)")
        p.add_argument("--init", default="",
                       help="continue from this drafter, a file or a shipped name (e.g. "
                            "smollm2-135m-eagle3), with its shape, vocabulary and feature "
                            "statistics and a fresh optimizer and schedule: more steps or more "
                            "data on a trained drafter (--draft-vocab and --ffn can grow it)")
        RECIPES[kind].add_args(p)
        p.add_argument("--vat", action="store_true",
                       help="verification-aware training: head + adaptive weighting")
        p.add_argument("--vat-head", action="store_true", help="VAT verification head only")
        p.add_argument("--vat-weight", action="store_true",
                       help="VAT adaptive position weighting only")
        p.add_argument("--ckpt-every", type=int, default=25, help="Orbax checkpoint interval")
        p.add_argument("--stop-after", type=int, default=0,
                       help="stop after this many steps with a checkpoint, as if interrupted "
                            "(the learning-rate schedule stays that of --steps; rerun to go on)")
        p.add_argument("--eval-every", type=int, default=50,
                       help="held-out simulated τ every N steps and at the end (0: never)")
        p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per eval")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--mesh", default="",
                       help="DATAxMODEL, e.g. 2x4: train on a device mesh (batch rows over data; "
                            "heads, MLP, vocabulary over model; jspec.sharding.RULES). Needs "
                            "DATA*MODEL devices (all hosts together)")
        p.add_argument("--distributed", action="store_true",
                       help="call jax.distributed.initialize() first (multi-host: run the same "
                            "command on every host; see docs/SCALING.md)")
        p.add_argument("--matmul-dtype", choices=("float32", "bfloat16"), default="float32",
                       help="operands of the training matmuls (float32 accumulation and float32 "
                            "parameters either way)")
        p.add_argument("--f32", action="store_true",
                       help="write the drafter in float32 (default bfloat16, half the size)")
