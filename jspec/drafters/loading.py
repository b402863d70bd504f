"""`load_drafter(name_or_path, target=model)`."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax

from jspec import defaults, safetensors_io
from jspec.drafters import d2sd, interop, kinds, ngram, topk_tree
from jspec.drafters.draft_model import DraftModel
from jspec.drafters.ngram import NGram
from jspec.drafters.trained import check_target, load_drafter_file
from jspec.errors import JspecError, ModelLoadError
from jspec.models.model import load_model
from jspec.provenance import machine_class
from jspec.specs import Registry, split_spec

ASSETS = Path(__file__).resolve().parent.parent / "assets"
# Trained drafters shipped with jspec: name -> file in jspec/assets.
SHIPPED = {"smollm2-135m-eagle3": "smollm2-135m-eagle3.safetensors",
           # The earlier EAGLE-3, trained on HumanEval + generated math only (better on code).
           "smollm2-135m-eagle3-code": "smollm2-135m-eagle3-code.safetensors",
           "smollm2-135m-dflash": "smollm2-135m-dflash.safetensors",
           # The earlier DFlash (HumanEval + generated math only); the shipped D²SD pairs with it.
           "smollm2-135m-dflash-code": "smollm2-135m-dflash-code.safetensors",
           # D²SD's second (variable-prefix) drafter; its file names the first (a DFlash).
           "smollm2-135m-d2sd": "smollm2-135m-d2sd.safetensors"}
TREE_OPTIONS = ("branches", "branch_len")  # D²SD: tree shape (static)


def drafter_file(name_or_path: str | os.PathLike) -> Path:
    """The file of a trained drafter: a shipped name's file in jspec/assets, else the path."""
    name = str(name_or_path)
    return ASSETS / SHIPPED[name] if name in SHIPPED else Path(name).expanduser()


# Options of a trained drafter (a shipped name or a .safetensors file).
TRAINED = Registry("trained-drafter")
TRAINED.register("file", lambda **kw: kw, {"cut": float, "branches": int, "branch_len": int},
                 usage="cut=P (D2SD: branches=N, branch_len=N)")
# Proposers around any chain drafter: "INNER+name:key=value,...".
WRAPPERS = Registry("proposer")
WRAPPERS.register("topk", topk_tree.from_options, {"k": int, "nodes": int, "width": int,
                                                  "draw": int},
                  usage="k=K,nodes=N,width=W,draw=0|1")
WRAPPERS.register("ngram", ngram.lookup_first, {"n_min": int, "n_max": int, "look": int},
                  usage="n_min=M,n_max=N,look=L")


def _trained(path: Path, target: Any, cut: float | None, name: str,
             tree_opts: dict[str, int] | None = None) -> Any:

    cfg, params, vocab = load_drafter_file(path)
    if target is None:
        if not cfg.target:
            raise JspecError(f"{path} does not name its target: pass target=")
        target = load_model(cfg.target)
    check_target(cfg, target.config)
    kind = kinds.get(cfg.kind)
    if kind.first_drafter:
        return _d2sd(path, cfg, params, vocab, target, cut, name, tree_opts or {})
    if tree_opts:
        raise JspecError(f"{sorted(tree_opts)}: only D2SD drafters take tree options")
    if cut is None:
        cut = 0.0
    if not 0.0 <= cut < 1.0:
        raise JspecError(f"cut must be in [0, 1), got {cut}")
    return kind.make(cfg, params, vocab, target.weights, cut=cut, name=name)


def _d2sd(path: Path, cfg: Any, params: Any, vocab: Any, target: Any, cut: float | None,
          name: str, tree_opts: dict[str, int]) -> Any:
    """The D²SD tree drafter: the first drafter named in the file's metadata + this one."""


    if cut is not None:
        raise JspecError("D2SD drafts whole blocks: cut= does not apply")
    first_ref = safetensors_io.read_metadata(path).get(d2sd.META_FIRST)
    if not first_ref:
        raise JspecError(f"{path} does not name its first drafter ({d2sd.META_FIRST})")
    if first_ref not in SHIPPED and not Path(first_ref).is_absolute():
        first_ref = str(path.parent / first_ref)
    first = load_drafter(first_ref, target=target)
    return d2sd.make(first, cfg, params, vocab, target.weights, name=name, **tree_opts)


def load_drafter(name_or_path: str | os.PathLike, *, target: Any = None, best: bool = False
                 ) -> Any:
    """A drafter for `target` (a loaded Model).

    Accepts: "ngram" or "ngram:n=3" / "ngram:n_max=4,n_min=2"; "early-exit:N" (the target's
    first N layers + its final norm and LM head); a shipped trained drafter
    ("smollm2-135m-eagle3", "smollm2-135m-dflash", optionally ":cut=0.5" to stop drafting where
    the VAT verification head's probability falls below 0.5; "smollm2-135m-d2sd", the D²SD tree
    drafter, optionally ":branches=4,branch_len=1" (the defaults)) or a `.safetensors` file written
    by `python -m train`; an EAGLE-3 checkpoint directory (SpecForge / vLLM layout) or a DFlash
    one (z-lab release layout), or one written by `python -m train export`
    (`jspec.drafters.interop`); a Hugging Face directory or .gguf file of a small Llama-family
    model with the target's tokenizer. `target` may be omitted for trained drafters (their target is
    loaded by name). Any chain drafter followed by "+topk[:k=K,nodes=N,width=W]" proposes its top-k token
    tree instead (`jspec.drafters.topk_tree`; defaults k=4, nodes=16; an EAGLE-3 inner drafter
    grows it EAGLE-2 style, expanding `width` nodes per level, default k, and at T > 0 draws the
    children from its q unless ",draw=0" is given); followed by
    "+ngram[:n_min=M,n_max=N,look=L]" it gives way to the n-gram lookup where the text repeats
    (`jspec.drafters.ngram.LookupFirst`; looked-up chains of up to L tokens, default k), also
    after "+topk" (the looked-up chain then replaces a row's tree).

    A drafter with a `jspec.defaults` record (the shipped ones, or one the user calibrated)
    carries its measured settings (`settings`, `jspec.defaults.Settings`): the best chain
    length `k`, what `generate` verifies per round when given no `length=`, and `max_batch`:
    past that batch such a `generate` decodes plainly (speculation stops paying there).
    `best=True` loads the record's whole configuration: the proposer it names wrapped around
    the drafter (`jspec.defaults.resolve`: on a `cpu` machine "smollm2-135m-eagle3" gives
    "smollm2-135m-eagle3+ngram"); without it a name loads that drafter alone. The record is
    that of the machine class of the target's devices (its weights' sharding: a TPU
    generation for weights laid out on a TPU topology, even when compiled from a CPU host),
    else of this host.
    """
    machine = _machine_of(target)
    name = defaults.resolve(str(name_or_path), machine) if best else str(name_or_path)
    drafter = _load(name, target)
    record = defaults.lookup(name, machine)
    return drafter if record is None else dataclasses.replace(drafter, default_k=record.k,
                                                              max_batch=record.max_batch)


def _machine_of(target: Any) -> str | None:
    """The machine class of the devices the target's weights are on (None: this host's)."""
    for a in jax.tree.leaves(getattr(target, "weights", None)):
        sh = getattr(a, "sharding", None)
        if isinstance(sh, jax.sharding.Sharding) and not isinstance(a, jax.core.Tracer):
            return machine_class(next(iter(sh.device_set)))
    return None


def _load(name: str, target: Any) -> Any:
    inner, plus, wrap = name.rpartition("+")
    if plus and inner and split_spec(wrap)[0] in WRAPPERS:
        return WRAPPERS.parse(wrap, inner=load_drafter(inner, target=target))  # inner's k
    kind = name.partition(":")[0]
    if kind in SHIPPED or kind.endswith(".safetensors"):
        opts = TRAINED.options("file", split_spec(name)[1])
        cut = opts.pop("cut", None)
        tree_opts = opts
        path = ASSETS / SHIPPED[kind] if kind in SHIPPED else Path(kind).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"drafter file {path} not found")
        return _trained(path, target, cut, name, tree_opts)
    ckpt = Path(name).expanduser()
    if ckpt.is_dir() and interop.checkpoint_kind(ckpt) is not None:  # EAGLE-3 / DFlash layouts
        return interop.load_checkpoint(ckpt, target, name=name)
    if target is None:
        raise JspecError(f"load_drafter({name!r}) needs target=")
    if kind in NAMED:
        return NAMED.parse(name, target=target, name=name)
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"unknown drafter {name!r}: expected ngram[:n=N], early-exit:N, or a model directory")
    draft = load_model(path, dtype=target.config.dtype)
    check_same_tokenizer(target, draft)
    return DraftModel(weights=draft.weights, config=draft.config, name=name)


def _ngram(*, target: Any, name: str, n: int | None = None, n_max: int | None = None,
           n_min: int | None = None) -> NGram:
    if n is not None and n_max is not None:
        raise JspecError("ngram: n is n_max; give one of them")
    top = n if n is not None else n_max
    return NGram(**({} if top is None else {"n_max": top}),
                 **({} if n_min is None else {"n_min": n_min}))


def _early_exit(*, target: Any, name: str, layers: int | None = None) -> DraftModel:
    if layers is None:
        raise JspecError(f"early-exit needs a layer count, e.g. early-exit:6, got {name!r}")
    if not 1 <= layers < target.config.num_layers:
        raise JspecError(f"early-exit:N needs 1 <= N < {target.config.num_layers}, got {layers}")
    return DraftModel(weights=target.weights, config=target.config, num_layers=layers, name=name,
                      shares_target=True)


# Drafters named by a spec (files and directories are recognised by their path).
NAMED = Registry("drafter")
NAMED.register("ngram", _ngram, {"n": int, "n_max": int, "n_min": int},
               usage="n=N or n_max=N,n_min=M")
NAMED.register("early-exit", _early_exit, {"layers": int}, positional="layers", usage="N")


def check_same_tokenizer(target: Any, draft: Any) -> None:
    """Raise unless `draft` can propose token ids in `target`'s vocabulary."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise JspecError(f"drafter vocabulary ({draft.config.vocab_size}) differs from the "
                         f"target's ({target.config.vocab_size}); they must share a tokenizer")
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is not None and dt is not None and tt.get_vocab() != dt.get_vocab():
        raise JspecError("drafter tokenizer differs from the target's; they must share a tokenizer")
