"""`python -m train export --format eagle3|dflash DRAFTER OUT/`: a jspec drafter as a community
checkpoint directory (SpecForge / vLLM EAGLE-3 layout, z-lab DFlash layout).

DRAFTER is anything `jspec.load_drafter` reads (a shipped name such as smollm2-135m-eagle3, a
`.safetensors` file from `python -m train`, or a checkpoint directory). The target is the one
the drafter names, or `--model`. `jspec.load_drafter(OUT, target=model)` reads the result back
with bit-identical drafts; what vLLM / SGLang make of it is in `jspec.drafters.interop`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from jspec.drafters.interop import FORMATS, export_drafter
from jspec.drafters.loading import load_drafter
from jspec.errors import JspecError
from jspec.models.model import load_model


def run(args: argparse.Namespace) -> int:
    try:
        target = load_model(args.model) if args.model else None
        drafter = load_drafter(args.drafter, target=target)
        if target is None:  # the drafter named its target and loaded it; load it here too
            target = load_model(drafter.cfg.target)
        cfg = export_drafter(drafter, args.out, args.format, target=target, dtype=args.dtype)
    except JspecError as e:
        raise SystemExit(f"error: {e}") from e
    files = sorted(p.name for p in Path(args.out).iterdir())
    print(f"wrote {args.out}: {', '.join(files)} ({cfg['architectures'][0]}, "
          f"feature layers {list(drafter.cfg.feature_layers)} in jspec's numbering)")
    if "jspec" in cfg:
        print("note: jspec-specific parts (config 'jspec' section"
              + (f", {cfg['jspec']['extra_tensors']}" if "extra_tensors" in cfg["jspec"] else "")
              + ") are read by jspec only: " + json.dumps(
                  {k: cfg["jspec"][k] for k in ("feature_norm", "block_input", "qk_norm")
                   if k in cfg["jspec"]}))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="write a drafter as an EAGLE-3 / DFlash checkpoint directory",
                       description=__doc__)
    p.set_defaults(func=run)
    p.add_argument("drafter", help="drafter name, .safetensors file or checkpoint directory")
    p.add_argument("out", help="output directory (config.json, model.safetensors, ...)")
    p.add_argument("--format", choices=FORMATS, required=True,
                   help="eagle3 (LlamaForCausalLMEagle3) or dflash (DFlashDraftModel)")
    p.add_argument("--model", default="",
                   help="target model (registry name, .gguf or HF directory); default: the one "
                        "the drafter names")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="tensor dtype (default float32: exact for any drafter; bfloat16 is exact "
                        "for drafters trained and saved in bfloat16, such as the shipped ones)")
