"""`load_drafter(name_or_path, target=model)`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jspec.drafters import interop, topk_tree
from jspec.drafters.draft_model import DraftModel
from jspec.drafters.ngram import NGram
from jspec.errors import JspecError, ModelLoadError


def _kv_args(spec: str) -> dict[str, int]:
    out = {}
    for part in filter(None, spec.split(",")):
        k, sep, v = part.partition("=")
        if not sep:
            raise JspecError(f"bad drafter option {part!r}: expected key=value")
        try:
            out[k.strip()] = int(v)
        except ValueError as e:
            raise JspecError(f"bad drafter option {part!r}: value must be an integer") from e
    return out


ASSETS = Path(__file__).resolve().parent.parent / "assets"
# Trained drafters shipped with jspec: name -> file in jspec/assets.
SHIPPED = {"smollm2-135m-eagle3": "smollm2-135m-eagle3.safetensors",
           "smollm2-135m-dflash": "smollm2-135m-dflash.safetensors",
           # D²SD's second (variable-prefix) drafter; its file names the first (the DFlash).
           "smollm2-135m-d2sd": "smollm2-135m-d2sd.safetensors"}
TREE_OPTIONS = ("branches", "branch_len")  # D²SD: tree shape (static)
# Proposers around any chain drafter: "INNER+name:key=value,...".
WRAPPERS = {"topk": topk_tree.from_options}


def _trained(path: Path, target: Any, cut: float | None, name: str,
             tree_opts: dict[str, int] | None = None) -> Any:
    from jspec.drafters import dflash, eagle3  # noqa: PLC0415
    from jspec.drafters.trained import check_target, load_drafter_file  # noqa: PLC0415
    from jspec.models.model import load_model  # noqa: PLC0415

    cfg, params, vocab = load_drafter_file(path)
    if target is None:
        if not cfg.target:
            raise JspecError(f"{path} does not name its target: pass target=")
        target = load_model(cfg.target)
    check_target(cfg, target.config)
    if cfg.kind == "d2sd":
        return _d2sd(path, cfg, params, vocab, target, cut, name, tree_opts or {})
    if tree_opts:
        raise JspecError(f"{sorted(tree_opts)}: only D2SD drafters take tree options")
    mod = {"eagle3": eagle3, "dflash": dflash}.get(cfg.kind)
    if mod is None:
        raise JspecError(f"{path}: unknown drafter kind {cfg.kind!r}")
    if cut is None:
        cut = 0.0
    if not 0.0 <= cut < 1.0:
        raise JspecError(f"cut must be in [0, 1), got {cut}")
    return mod.make(cfg, params, vocab, target.weights, cut=cut, name=name)


def _d2sd(path: Path, cfg: Any, params: Any, vocab: Any, target: Any, cut: float | None,
          name: str, tree_opts: dict[str, int]) -> Any:
    """The D²SD tree drafter: the first drafter named in the file's metadata + this one."""
    from safetensors import safe_open  # noqa: PLC0415

    from jspec.drafters import d2sd  # noqa: PLC0415

    if cut is not None:
        raise JspecError("D2SD drafts whole blocks: cut= does not apply")
    with safe_open(str(path), "np") as f:
        first_ref = (f.metadata() or {}).get(d2sd.META_FIRST)
    if not first_ref:
        raise JspecError(f"{path} does not name its first drafter ({d2sd.META_FIRST})")
    if first_ref not in SHIPPED and not Path(first_ref).is_absolute():
        first_ref = str(path.parent / first_ref)
    first = load_drafter(first_ref, target=target)
    return d2sd.make(first, cfg, params, vocab, target.weights, name=name, **tree_opts)


def load_drafter(name_or_path: str | os.PathLike, *, target: Any = None) -> Any:
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
    loaded by name). Any chain drafter followed by "+topk[:k=K,nodes=N]" proposes its top-k token
    tree instead (`jspec.drafters.topk_tree`; defaults k=4, nodes=16).
    """
    from jspec.models.model import load_model  # noqa: PLC0415

    name = str(name_or_path)
    inner, plus, wrap = name.rpartition("+")
    if plus and inner and wrap.partition(":")[0] in WRAPPERS:
        w, _, opts = wrap.partition(":")
        return WRAPPERS[w](load_drafter(inner, target=target), _kv_args(opts))
    kind, _, arg = name.partition(":")
    if kind in SHIPPED or kind.endswith(".safetensors"):
        cut = None
        tree_opts = {}
        for part in filter(None, arg.split(",")):
            k, sep, v = part.partition("=")
            if k in TREE_OPTIONS and sep:
                tree_opts.update(_kv_args(part))
                continue
            if k != "cut" or not sep:
                raise JspecError(f"bad trained-drafter option {part!r}: cut=P (D2SD: "
                                 "branches=N, branch_len=N)")
            try:
                cut = float(v)
            except ValueError as e:
                raise JspecError(f"bad cut value {v!r}") from e
        path = ASSETS / SHIPPED[kind] if kind in SHIPPED else Path(kind).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"drafter file {path} not found")
        return _trained(path, target, cut, name, tree_opts)
    ckpt = Path(name).expanduser()
    if ckpt.is_dir() and interop.checkpoint_kind(ckpt) is not None:  # EAGLE-3 / DFlash layouts
        return interop.load_checkpoint(ckpt, target, name=name)
    if target is None:
        raise JspecError(f"load_drafter({name!r}) needs target=")
    if kind == "ngram":
        kw = _kv_args(arg)
        if "n" in kw:
            kw["n_max"] = kw.pop("n")
        unknown = set(kw) - {"n_max", "n_min"}
        if unknown:
            raise JspecError(f"unknown ngram option(s) {sorted(unknown)} (n, n_max, n_min)")
        return NGram(**kw)
    if kind == "early-exit":
        try:
            n = int(arg)
        except ValueError as e:
            raise JspecError(f"early-exit needs a layer count, e.g. early-exit:6, got {name!r}") from e
        if not 1 <= n < target.config.num_layers:
            raise JspecError(f"early-exit:N needs 1 <= N < {target.config.num_layers}, got {n}")
        return DraftModel(weights=target.weights, config=target.config, num_layers=n, name=name)
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"unknown drafter {name!r}: expected ngram[:n=N], early-exit:N, or a model directory")
    draft = load_model(path, dtype=target.config.dtype)
    check_same_tokenizer(target, draft)
    return DraftModel(weights=draft.weights, config=draft.config, name=name)


def check_same_tokenizer(target: Any, draft: Any) -> None:
    """Raise unless `draft` can propose token ids in `target`'s vocabulary."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise JspecError(f"drafter vocabulary ({draft.config.vocab_size}) differs from the "
                         f"target's ({target.config.vocab_size}); they must share a tokenizer")
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is not None and dt is not None and tt.get_vocab() != dt.get_vocab():
        raise JspecError("drafter tokenizer differs from the target's; they must share a tokenizer")
