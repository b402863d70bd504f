"""End to end on the real model: SmolLM2-135M read as an HF safetensors directory, the shipped
drafters exported by `python -m train export` and imported back decode exactly as the
native files (greedy tokens and τ)."""

from __future__ import annotations

import numpy as np
import pytest

import jspec
from jspec.drafters.trained import to_flat
from jspec.models import registry
from jspec.prompts import load_prompt_set
from train.__main__ import main as train_main


@pytest.mark.slow
@pytest.mark.real
@pytest.mark.parametrize("name,fmt,k", [("smollm2-135m-eagle3", "eagle3", 3),
                                        ("smollm2-135m-dflash", "dflash", 7)])
def test_exported_shipped_drafter_decodes_like_the_native_file(tmp_path, name, fmt, k):
    hf_dir = registry.converted_dir(registry.REGISTRY["smollm2-135m"])
    assert (hf_dir / "config.json").is_file() and (hf_dir / "model.safetensors").is_file()
    target = jspec.load_model(str(hf_dir))  # the HF-directory path, not the registry name
    out = tmp_path / fmt
    assert train_main(["export", "--format", fmt, name, str(out), "--model", str(hf_dir),
                       "--dtype", "bfloat16"]) == 0  # the shipped files are bfloat16: exact
    native = jspec.load_drafter(name, target=target)
    imported = jspec.load_drafter(str(out), target=target)
    assert imported.cfg == native.cfg
    mine, theirs = to_flat(native.params), to_flat(imported.params)
    for p in mine:
        np.testing.assert_array_equal(np.asarray(theirs[p]), np.asarray(mine[p]), err_msg=p)
    prompts = [r["text"] for r in load_prompt_set("humaneval:2")]
    for text in prompts:
        ids = np.asarray([target.encode(text)], np.int32)
        kw = dict(max_new_tokens=64, length=jspec.FixedLength(k))
        a = jspec.generate(target, ids, drafter=native, **kw)
        b = jspec.generate(target, ids, drafter=imported, **kw)
        np.testing.assert_array_equal(np.asarray(b.tokens), np.asarray(a.tokens))
        assert float(b.stats.mean_accepted()[0]) == float(a.stats.mean_accepted()[0])
        np.testing.assert_array_equal(np.asarray(b.stats.accepted_at),
                                      np.asarray(a.stats.accepted_at))
        ar = jspec.generate(target, ids, max_new_tokens=64)
        np.testing.assert_array_equal(np.asarray(b.tokens), np.asarray(ar.tokens))
