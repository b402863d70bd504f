"""`python -m jspec`: generate text and run benchmarks from the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from jspec import defaults
from jspec.cli_args import add_bench_parser, add_impl_args
from jspec.errors import JspecError


def _shipped_defaults() -> str:
    """The shipped records, for --help: "cpu-bf16: plain decoding bfloat16, smollm2-135m-eagle3
    k=3 bfloat16, ...; ..."."""
    try:
        data = defaults.read(defaults.SHIPPED)
    except JspecError:
        return "(unreadable)"
    return "; ".join(f"{cls}: " + ", ".join(
        f"plain decoding {r.get('dtype')}" if n == defaults.PLAIN
        else f"{n} plain {r.get('dtype')} (no k beat it)" if r.get("max_batch") == 0
        else f"{n}" + (f" as {n}+{r['proposer']}" if r.get("proposer") else "")
        + f" k={r.get('k')} {r.get('dtype')}"
        + (f" up to batch {r['max_batch']}" if r.get("max_batch") else "")
        for n, r in table.items()) for cls, table in data.items()) or "none"


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 (default) is greedy decoding")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling mass in (0, 1] (1 = all)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling (default 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jspec", description="jspec: JAX-native speculative decoding. Also: "
        "`python -m jspec aot --help`, a TPU report compiled here before renting a slice.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt or a JSONL file of prompts",
                       description="Generate text with the target model (plain autoregressive "
                                   "decoding, or speculative decoding with --drafter).")
    g.add_argument("--model", default="smollm2-135m",
                   help="registry name, .gguf file or HF directory (default smollm2-135m)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompts-file", type=Path,
                     help="JSONL file, one object per line with a 'prompt' key")
    g.add_argument("--batch-size", type=int, default=1,
                   help="decode --prompts-file N prompts at a time (default 1: one by one, "
                        "text streamed). Prompts are grouped by length, padded to width buckets "
                        "(one compile per bucket), printed in input order; a bad line or a "
                        "too-long prompt is named on stderr and skipped (exit status 1 after "
                        "the others' output). --json 'seconds' is then the batch's wall time")
    g.add_argument("--max-new-tokens", type=int, default=128,
                   help="maximum new tokens per prompt (default 128)")
    g.add_argument("--raw", action="store_true",
                   help="feed the prompt as is instead of through the model's chat template")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (prompt, text, token_ids, new_tokens, "
                        "rounds, mean_accepted, seconds, provenance: machine, jax/jaxlib, dtype, "
                        "command line) instead of streaming text")
    g.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="weights/activations dtype (default: the measured-best record for this "
                        "machine class, the drafter's with --drafter, else plain decoding's, so "
                        "the two agree unless told; classes: cpu-bf16 = a CPU with AVX512-BF16/"
                        "AMX or Arm BF16, cpu = one without, gpu, tpu; $JSPEC_MACHINE_CLASS "
                        f"overrides; shipped: {_shipped_defaults()}; float32 with no record). "
                        "--json's provenance.dtype says which ran. bfloat16 decodes ~1.8x faster "
                        "than float32 on a cpu-bf16 machine (about as fast on a cpu one) and "
                        "verifies K tokens almost at the cost of one, but a near-tie can round "
                        "differently in the verify pass than in a one-token step, so greedy "
                        "speculative output may differ from greedy decoding there "
                        "(docs/BENCHMARKS.md)")
    g.add_argument("--drafter", help="speculative decoding with this drafter: ngram[:n=N], "
                                     "early-exit:N, a shipped trained drafter "
                                     "(smollm2-135m-eagle3, smollm2-135m-eagle3-code = "
                                     "the earlier code + math EAGLE-3, smollm2-135m-dflash, "
                                     "smollm2-135m-dflash-code = the earlier DFlash, "
                                     "smollm2-135m-d2sd[:branches=4,branch_len=1] = D²SD tree "
                                     "drafting, use --k 7), or a draft model directory / .gguf; "
                                     "any chain drafter + '+topk[:k=K,nodes=N,width=W]' "
                                     "proposes its top-k token tree (EAGLE-3 at T > 0: drawn "
                                     "from q, draw=0: its most probable children), "
                                     "+ '+ngram[:n_min=2,look=L]' (after a chain "
                                     "drafter or a +topk tree) gives way to "
                                     "the n-gram lookup where the text repeats (looked-up "
                                     "chains up to L tokens, default k). A name whose "
                                     "record (see --dtype) names a proposer runs with it, "
                                     "e.g. smollm2-135m-eagle3 as smollm2-135m-eagle3+ngram "
                                     "on a cpu machine (lossless, chain lengths; "
                                     "--drafter-alone: without it). Default: plain "
                                     "autoregressive decoding")
    g.add_argument("--drafter-alone", action="store_true",
                   help="use --drafter by itself, not inside the proposer its record names")
    g.add_argument("--k", type=int, help="drafted tokens verified per round (default: the "
                                          "drafter's record, see --dtype; else 5; past the "
                                          "record's batch limit, plain decoding, which is "
                                          "faster there); short for --length fixed:K")
    g.add_argument("--length", help="speculation length policy: fixed:K, or "
                                    "libraspec[:n=N,d_max=D,alpha=A,widths=W1/W2/..] (per-row "
                                    "dynamic length from the drafter's confidences; block "
                                    "drafters such as DFlash; defaults n=16, d_max=24, "
                                    "alpha=2.2; calibrate alpha with `jspec calibrate-length`)")
    g.add_argument("--verifier", default="lossless",
                   help="lossless (default); asd[:budget=B,gate=G,cap=M] (greedy only); "
                        "diversed[:w=W | :head=PATH] (w = weight on the target in w*p+(1-w)*q; "
                        "head = a learned weight from `python -m train diversed`). ASD and "
                        "DIVERSED are approximate: the output may differ from the target's")
    g.add_argument("--mesh", help="DATAxMODEL, e.g. 1x8: run sharded on a device mesh (weights "
                                  "over model by jspec.sharding.RULES; see docs/SCALING.md)")
    g.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first (multi-host: run the same command "
                        "on every host; under `python -m jspec.launch` it joins by itself); "
                        "only process 0 prints")
    _add_sampling_args(g)
    add_impl_args(g)

    c = sub.add_parser("calibrate-asd", help="calibrate ASD's regret gate on real prompts",
                       description="Run strict greedy speculative decoding and set ASD's gate to "
                                   "the 25th percentile of positive regret/value ratios at the "
                                   "native first-rejection points (the reference recipe).")
    c.add_argument("--model", default="smollm2-135m", help="target model (default smollm2-135m)")
    c.add_argument("--drafter", required=True, help="drafter, e.g. early-exit:10 or ngram")
    c.add_argument("--k", type=int, default=4, help="drafted tokens per round (default 4)")
    c.add_argument("--prompts", default="humaneval:0-24",
                   help="prompt set and range (default humaneval:0-24)")
    c.add_argument("--max-new-tokens", type=int, default=96, help="tokens per prompt (default 96)")
    c.add_argument("--percentile", type=float, default=25.0, help="percentile (default 25)")
    c.add_argument("--out", type=Path, default=Path("asd_gate.json"),
                   help="where to save the result (default asd_gate.json)")

    cd = sub.add_parser(
        "calibrate", help="measure a drafter's best chain length and dtype on this machine",
        description="Time plain decoding and the drafter at every K in each dtype on real "
                    "prompts (batch 1; one warm-up and one timed call per prompt), print the "
                    "table and the best; --save makes it the default `generate` uses for this "
                    "drafter on this machine class (the user's jspec.defaults record: "
                    "$JSPEC_DEFAULTS, else ~/.config/jspec/defaults.json; it overrides the "
                    "shipped record of the class).")
    cd.add_argument("--model", default="smollm2-135m", help="target model (default smollm2-135m)")
    cd.add_argument("--drafter", required=True, help="drafter spec, as for generate --drafter")
    cd.add_argument("--ks", default="2,3,4,5", help="chain lengths to try (default 2,3,4,5)")
    cd.add_argument("--proposers", default=None,
                    help="proposers to try around the drafter, comma-separated, 'none' for the "
                         "drafter alone, e.g. none,ngram (default: none, and the proposer the "
                         "drafter's current record names); --save records the best one")
    cd.add_argument("--dtypes", default="bfloat16,float32",
                    help="target dtypes to try (default bfloat16,float32)")
    cd.add_argument("--prompts", default="humaneval:8-16",
                    help="prompt set and range (default humaneval:8-16: held out from the "
                         "drafters' training and disjoint from the benchmarks' 0-7); several "
                         "joined by commas, e.g. humaneval:8-16,gsm8k:8-16")
    cd.add_argument("--max-new-tokens", type=int, default=96,
                    help="tokens per prompt (default 96)")
    cd.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature (default 0: greedy)")
    cd.add_argument("--save", action="store_true",
                    help="write the best as this drafter's default (user record)")

    cl = sub.add_parser(
        "calibrate-length", help="fit LibraSpec's n and alpha to this machine's c(K)",
        description="Measure this machine's verification cost t(K) and the drafter's cost per "
                    "block, record the drafter's confidences and the oracle length on real "
                    "prompts (greedy, every round drafting and verifying d_max tokens), then "
                    "simulate every fixed K and LibraSpec over a grid of (n, alpha) on those "
                    "rounds and print the best. Run it on the device you decode on: a TPU/GPU "
                    "has a flatter c(K) and wants a larger alpha.")
    cl.add_argument("--model", default="smollm2-135m", help="target model (default smollm2-135m)")
    cl.add_argument("--drafter", default="smollm2-135m-dflash",
                    help="block drafter (default smollm2-135m-dflash)")
    cl.add_argument("--d-max", type=int, default=24, help="LibraSpec cap d_max (default 24)")
    cl.add_argument("--prompts", default="humaneval:8-16",
                    help="prompt set and range (default humaneval:8-16: held out from drafter "
                         "training, disjoint from the benchmarks' humaneval:8)")
    cl.add_argument("--max-new-tokens", type=int, default=96, help="tokens per prompt (default 96)")
    cl.add_argument("--fill", type=int, default=400, help="cache fill for t(K) (default 400)")
    cl.add_argument("--repeats", type=int, default=20,
                    help="interleaved timing sweeps over K, median per K (default 20)")
    cl.add_argument("--out", type=Path, default=Path("libraspec_calibration.json"),
                    help="where to save the measurements and the grid "
                         "(default libraspec_calibration.json)")

    add_bench_parser(sub)

    pl = sub.add_parser("plot", help="draw a saved bench JSON (or a training log.jsonl)",
                        description="Draw the pictures of `bench --plot` from a bench JSON "
                                    "written with --json-out, without re-running it; a "
                                    "`python -m train` log.jsonl gives its loss / tau curves.")
    pl.add_argument("json", help="bench JSON (--json-out) or training log.jsonl")
    pl.add_argument("out", help="PNG to write")
    return parser


def _read_prompts(args: argparse.Namespace, skip_bad: bool = False) -> list[tuple[str, str]]:
    """(where, prompt) pairs. A bad line is an error, or with `skip_bad` named on stderr and
    skipped."""
    if args.prompt is not None:
        if not args.prompt.strip():
            raise JspecError("the prompt is empty")
        return [("--prompt", args.prompt)]
    path: Path = args.prompts_file
    if not path.is_file():
        raise JspecError(f"prompts file not found: {path}")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        problem = None
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            problem = f"{path}:{n}: not valid JSON ({e.msg})"
        else:
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                problem = f"{path}:{n}: expected an object with a string 'prompt' key"
            elif not obj["prompt"].strip():
                problem = f"{path}:{n}: the prompt is empty"
        if problem is None:
            prompts.append((f"{path}:{n}", obj["prompt"]))
        elif skip_bad:
            print(f"skipped {problem}", file=sys.stderr)
        else:
            raise JspecError(problem)
    if not prompts:
        raise JspecError(f"{path} holds no usable prompts")
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    import jax  # noqa: PLC0415 (keep --help fast)
    import numpy as np  # noqa: PLC0415

    import jspec  # noqa: PLC0415
    from jspec import launch  # noqa: PLC0415
    from jspec.decode import plain_is_faster, stream  # noqa: PLC0415
    from jspec.drafters.base import settings_of  # noqa: PLC0415
    from jspec.provenance import machine_class, provenance  # noqa: PLC0415

    # Before any other JAX call: join the other processes (under jspec.launch, or --distributed).
    launch.initialize(fallback=args.distributed)
    show = jax.process_index() == 0  # every process runs the same program; one prints
    if args.max_new_tokens < 1:
        raise JspecError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sampling = jspec.Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    length = _length(args)
    if args.batch_size < 1:
        raise JspecError(f"--batch-size must be >= 1, got {args.batch_size}")
    batched = args.batch_size > 1
    prompts = _read_prompts(args, skip_bad=batched)
    n_read = len(prompts)
    from jspec.verify import parse_verifier, with_acceptance_impl  # noqa: PLC0415

    mesh = jspec.sharding.parse_mesh(args.mesh) if args.mesh else None
    if not args.drafter and (length is not None or args.verifier != "lossless"
                             or args.acceptance_impl != "xla" or args.drafter_alone):
        raise JspecError("--k/--length/--verifier/--acceptance-impl/--drafter-alone need "
                         "--drafter")
    verifier = with_acceptance_impl(parse_verifier(args.verifier), args.acceptance_impl)
    if args.dtype is None:  # the measured best: the drafter's record, else plain decoding's
        args.dtype = defaults.dtype_for(args.drafter)
    model = jspec.load_model(args.model, dtype=args.dtype).with_attention_impl(args.attention_impl)
    if mesh is not None:  # place the weights once (not per prompt), before a drafter shares them
        model = jspec.sharding.shard_model(model, mesh)
    spec_name = args.drafter
    if args.drafter and not args.drafter_alone and default_proposer_applies(verifier, length):
        spec_name = defaults.resolve(args.drafter)
        if spec_name != args.drafter and show:
            print(f"note: --drafter {args.drafter} runs as {spec_name}, its measured-best "
                  f"configuration on this {machine_class()} machine (its jspec.defaults "
                  f"record); --drafter-alone runs it without", file=sys.stderr)
    drafter = jspec.load_drafter(spec_name, target=model) if args.drafter else None
    if mesh is not None:
        drafter = jspec.sharding.shard_drafter(drafter, mesh)
    if drafter is not None and plain_is_faster(drafter, length, verifier, args.batch_size):
        limit = settings_of(drafter).max_batch
        where = ("at every batch" if limit == 0 else f"past batch {limit}")
        print(f"note: on this {machine_class()} machine {args.drafter} was measured slower than "
              f"plain decoding {where} (its jspec.defaults record), so this decodes plainly; "
              f"pass --k to speculate anyway", file=sys.stderr)
        warnings.filterwarnings("ignore", category=jspec.PlainDecodingWarning)  # said above
    spec = dict(drafter=drafter, length=length, verifier=verifier if drafter else None, mesh=mesh)
    key = jax.random.key(args.seed)
    prov = provenance(dtype=args.dtype) if args.json else None  # machine, versions, command
    if prov is not None:
        prov["drafter"] = spec_name  # the configuration that ran (with its record's proposer)
    if batched:
        return _generate_batched(args, model, prompts, spec, sampling, key, prov, show,
                                 bad_lines=_count_lines(args) - n_read)
    for i, (_, text) in enumerate(prompts):
        ids = model.encode(text, chat=not args.raw)
        t0 = time.perf_counter()
        if args.json:
            out = jspec.generate(model, np.asarray([ids], np.int32),
                                 max_new_tokens=args.max_new_tokens, sampling=sampling,
                                 key=jax.random.fold_in(key, i), **spec)
            tokens, n, stats = jspec.sharding.to_host((out.tokens, out.lengths, out.stats))
            secs = time.perf_counter() - t0
            new = [int(t) for t in tokens[0, : int(n[0])]]
            # rounds: target verify passes after the prompt's (which gives the first token);
            # mean_accepted: tokens committed per such round (accepted drafts + 1).
            rec = {"prompt": text, "text": model.decode(new), "token_ids": new,
                   "new_tokens": len(new), "rounds": int(stats.rounds[0]),
                   "mean_accepted": round(float(stats.mean_accepted()[0]), 4),
                   "seconds": round(secs, 3), "provenance": prov}
            if show:
                print(json.dumps(rec), flush=True)
        else:
            shown = ""
            for tokens, num_new, _, _ in stream(model, np.asarray([ids], np.int32),
                                                max_new_tokens=args.max_new_tokens,
                                                sampling=sampling, key=jax.random.fold_in(key, i),
                                                **spec):
                text_now = model.decode(tokens[0, : int(num_new[0])])
                # Print only the stable part: a partial UTF-8 sequence decodes to U+FFFD.
                stable = text_now.rstrip("\ufffd")
                if stable.startswith(shown):
                    if show:
                        sys.stdout.write(stable[len(shown):])
                        sys.stdout.flush()
                    shown = stable
            if show:
                sys.stdout.write("\n\n" if len(prompts) > 1 else "\n")
    return 0


def _count_lines(args: argparse.Namespace) -> int:
    return sum(1 for x in args.prompts_file.read_text().splitlines() if x.strip()) \
        if args.prompts_file else 1


def _generate_batched(args: argparse.Namespace, model: Any, prompts: list[tuple[str, str]],
                      spec: dict[str, Any], sampling: Any, key: Any, prov: Any, show: bool,
                      bad_lines: int) -> int:
    """--batch-size N: `jspec.batched.generate_batches`, one output per prompt in input order;
    a prompt that cannot be decoded (too long for the context) is named and skipped. Exit
    status 1 when anything was skipped, after every other prompt's output."""
    from tqdm import tqdm  # noqa: PLC0415 (keep --help fast)

    from jspec.batched import generate_batches  # noqa: PLC0415

    limit = model.config.max_position
    ok, enc = [], []
    for where, text in prompts:
        ids = model.encode(text, chat=not args.raw)
        if len(ids) + args.max_new_tokens > limit:
            print(f"skipped {where}: prompt ({len(ids)} tokens) + max_new_tokens "
                  f"({args.max_new_tokens}) exceeds the model's context length {limit}",
                  file=sys.stderr)
            continue
        ok.append(text)
        enc.append(ids)
    skipped = bad_lines + len(prompts) - len(ok)
    if enc:
        bar = tqdm(total=len(enc), unit="prompt", disable=not show, file=sys.stderr,
                   dynamic_ncols=True)
        for res in generate_batches(model, enc, args.batch_size,
                                    max_new_tokens=args.max_new_tokens, sampling=sampling,
                                    key=key, **spec):
            bar.update(1)
            text = model.decode(res.tokens)
            if not show:
                continue
            if args.json:
                print(json.dumps({"prompt": ok[res.index], "text": text,
                                  "token_ids": res.tokens, "new_tokens": len(res.tokens),
                                  "rounds": res.rounds,
                                  "mean_accepted": round(res.mean_accepted, 4),
                                  "seconds": round(res.seconds, 3), "provenance": prov}),
                      flush=True)
            else:
                print(text + "\n", flush=True)
        bar.close()
    if skipped:
        print(f"{skipped} prompt(s) skipped (named above)", file=sys.stderr)
        return 1
    return 0


def default_proposer_applies(verifier: Any, length: Any) -> bool:
    """Whether `generate` wraps a drafter in its record's proposer: the configuration the
    record measured, lossless verification of a chain (no relaxed verifier, whose q or hidden
    states a looked-up chain lacks, and no LibraSpec block extension)."""
    from jspec.length import FixedLength  # noqa: PLC0415
    from jspec.verify import Lossless  # noqa: PLC0415

    return isinstance(verifier, Lossless) and (length is None or isinstance(length, FixedLength))


def _length(args: argparse.Namespace) -> Any:
    from jspec.length import FixedLength, parse_length  # noqa: PLC0415

    if args.k is not None and args.length is not None:
        raise JspecError("give --k or --length, not both")
    if args.k is not None:
        return FixedLength(args.k)
    if args.length is not None:
        return parse_length(args.length)
    return None


def cmd_calibrate_asd(args: argparse.Namespace) -> int:
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from tqdm import tqdm  # noqa: PLC0415

    import jspec  # noqa: PLC0415
    from jspec.prompts import load_prompt_set  # noqa: PLC0415

    if args.max_new_tokens < 2:
        raise JspecError("--max-new-tokens must be >= 2")
    if not 0 < args.percentile < 100:
        raise JspecError("--percentile must be in (0, 100)")
    rows = load_prompt_set(args.prompts)
    model = jspec.load_model(args.model)
    drafter = jspec.load_drafter(args.drafter, target=model)
    from jspec.state import bucket_length  # noqa: PLC0415

    recorder = jspec.ASD(budget=0.0, record=True)  # strict greedy, recording r/v
    enc = [model.encode(r["text"]) for r in rows]
    width = bucket_length(max(map(len, enc)))  # one width: one compile for all prompts
    ratios: list[float] = []
    for e in tqdm(enc, desc="calibrate-asd", unit="prompt"):
        ids = np.zeros((1, width), np.int32)
        ids[0, : len(e)] = e
        out = jspec.generate(model, ids, np.asarray([len(e)], np.int32),
                             max_new_tokens=args.max_new_tokens, drafter=drafter,
                             length=jspec.FixedLength(args.k), verifier=recorder)
        st = jax.device_get(out.verifier)
        ratios.extend(float(x) for x in st.ratios[0, : int(st.n_ratios[0])])
    if not ratios:
        raise JspecError("no rejection was observed: nothing to calibrate on")
    gate = float(np.percentile(ratios, args.percentile))
    res = {"gate": gate, "percentile": args.percentile, "n_ratios": len(ratios),
           "drafter": args.drafter, "k": args.k, "prompts": args.prompts, "model": args.model,
           "max_new_tokens": args.max_new_tokens}
    args.out.write_text(json.dumps(res, indent=1))
    print(f"ASD gate = {gate:.4f} (p{args.percentile:g} of {len(ratios)} positive r/v ratios); "
          f"saved to {args.out}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from jspec import bench  # noqa: PLC0415

    return bench.main(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["aot"]:  # its own parser: jspec/aot/__main__.py
        from jspec.aot.__main__ import main as aot  # noqa: PLC0415

        return aot(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "plot":
            from jspec.plot import main as plot_main  # noqa: PLC0415 (matplotlib)

            return plot_main(args)
        if args.command == "calibrate-asd":
            return cmd_calibrate_asd(args)
        if args.command == "calibrate":
            from jspec.calibrate_defaults import main as calibrate  # noqa: PLC0415

            return calibrate(args)
        if args.command == "calibrate-length":
            from jspec.calibrate import main as calibrate_length  # noqa: PLC0415

            return calibrate_length(args)
    except JspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 1
