"""Loading failures name what is wrong: unknown names, missing / truncated / foreign GGUF files
and HF directories, bad configs and tensors; the conversion cache's lock and file modes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import TINY_VARIANTS
from test_loading import random_model, write_gguf

import jspec
from jspec.models.loading import (
    weights_to_hf,
    write_hf_dir,
)

PATHS_PY = Path(jspec.__file__).parent / "paths.py"

# --------------------------------------------------------------------------------------------
# Bad input: always a ModelLoadError (a JspecError, a ValueError) that says what is wrong
# --------------------------------------------------------------------------------------------

def test_model_load_error_hierarchy():
    assert issubclass(jspec.ModelLoadError, jspec.JspecError)
    assert issubclass(jspec.ModelLoadError, ValueError)


def test_unknown_model_name():
    with pytest.raises(jspec.ModelLoadError, match=r"unknown model 'no-such-model'.*smollm2-135m"):
        jspec.load_model("no-such-model")


def test_missing_gguf_path(tmp_path):
    with pytest.raises(jspec.ModelLoadError, match="not found"):
        jspec.load_model(tmp_path / "missing.gguf")


def _valid_gguf(tmp_path, name="llama_tied_gqa2", **kw):
    path = tmp_path / "model.gguf"
    model = random_model(name)
    write_gguf(path, model.config, model.weights, **kw)
    return path


def test_truncated_gguf(tmp_path):
    path = _valid_gguf(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(jspec.ModelLoadError, match="truncated"):
        jspec.load_model(path)


@pytest.mark.parametrize("content", [b"", b"GGUF", b"this is not a GGUF file\n" * 20])
@pytest.mark.parametrize("filename", ["model.gguf", "model.bin"])
def test_not_a_gguf_file(tmp_path, content, filename):
    path = tmp_path / filename
    path.write_bytes(content)
    with pytest.raises(jspec.ModelLoadError, match="cannot read GGUF"):
        jspec.load_model(path)


def test_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(jspec.ModelLoadError, match=r"architecture 'gpt2'.*llama"):
        jspec.load_model(path)


def test_gguf_missing_metadata(tmp_path):
    path = _valid_gguf(tmp_path, skip_meta=("head_count",))
    with pytest.raises(jspec.ModelLoadError, match=r"llama\.attention\.head_count"):
        jspec.load_model(path)


def test_gguf_invalid_metadata(tmp_path):
    """4 query heads over 3 kv heads: ModelConfig rejects it; the loader says so as a ModelLoadError."""
    path2 = tmp_path / "bad2.gguf"
    w = gguf.GGUFWriter(str(path2), "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(48)
    w.add_head_count(4)
    w.add_head_count_kv(3)
    w.add_vocab_size(97)
    w.add_tensor("token_embd.weight", np.zeros((97, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(jspec.ModelLoadError, match="multiple of num_kv_heads"):
        jspec.load_model(path2)


def test_gguf_wrong_tensor_shape(tmp_path):
    cfg = TINY_VARIANTS["llama_tied_gqa2"]
    path = _valid_gguf(tmp_path, override={
        "blk.1.ffn_up.weight": np.zeros((cfg.ffn_size + 1, cfg.hidden_size), np.float32)})
    with pytest.raises(jspec.ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*shape"):
        jspec.load_model(path)


@pytest.fixture
def hf_dir(tmp_path):
    model = random_model("qwen2_bias")
    write_hf_dir(tmp_path, model.config, weights_to_hf(model.config, model.weights))
    return tmp_path


def test_hf_dir_without_config(hf_dir):
    (hf_dir / "config.json").unlink()
    with pytest.raises(jspec.ModelLoadError, match=r"no config\.json"):
        jspec.load_model(hf_dir)


def test_hf_dir_without_safetensors(hf_dir):
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(jspec.ModelLoadError, match=r"no \*\.safetensors"):
        jspec.load_model(hf_dir)


def test_hf_dir_truncated_safetensors(hf_dir):
    st = hf_dir / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    with pytest.raises(jspec.ModelLoadError, match="truncated or corrupt"):
        jspec.load_model(hf_dir)


def _edit_config(hf_dir, **changes):
    cfg = json.loads((hf_dir / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (hf_dir / "config.json").write_text(json.dumps(cfg))


def test_hf_dir_unsupported_model_type(hf_dir):
    _edit_config(hf_dir, model_type="gpt_neox")
    with pytest.raises(jspec.ModelLoadError, match=r"unsupported model_type 'gpt_neox'"):
        jspec.load_model(hf_dir)


@pytest.mark.parametrize("changes, match", [
    (dict(hidden_size=None), "hidden_size"),
    (dict(num_key_value_heads=3), "multiple of num_kv_heads"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
])
def test_hf_dir_bad_config_values(hf_dir, changes, match):
    _edit_config(hf_dir, **changes)
    with pytest.raises(jspec.ModelLoadError, match=match):
        jspec.load_model(hf_dir)


def test_hf_dir_config_not_json(hf_dir):
    (hf_dir / "config.json").write_text("{not json")
    with pytest.raises(jspec.ModelLoadError, match=r"bad config\.json"):
        jspec.load_model(hf_dir)


def _rewrite_tensors(hf_dir, edit):
    from safetensors.numpy import load_file, save_file

    st = hf_dir / "model.safetensors"
    tensors = load_file(str(st))
    edit(tensors)
    save_file(tensors, str(st))


def test_hf_dir_wrong_tensor_shape(hf_dir):
    name = "model.layers.0.self_attn.k_proj.weight"

    def transpose(t):
        t[name] = np.ascontiguousarray(t[name].T)
    _rewrite_tensors(hf_dir, transpose)
    with pytest.raises(jspec.ModelLoadError, match=rf"{name} has shape \(32, 16\), expected \(16, 32\)"):
        jspec.load_model(hf_dir)


def test_hf_dir_missing_tensor(hf_dir):
    name = "model.layers.1.self_attn.v_proj.bias"
    _rewrite_tensors(hf_dir, lambda t: t.pop(name))
    with pytest.raises(jspec.ModelLoadError, match=rf"missing tensor {name}"):
        jspec.load_model(hf_dir)


def test_cache_lock_serializes_processes(tmp_path):
    """Four processes take `cache_lock` on the same entry and each writes `start`, sleeps, then
    `end` to one file: with the lock the lines come in start/end pairs of one process; without
    it (`broken`: the same processes, no lock) they interleave, so the check can fail."""
    log = tmp_path / "log"
    # jspec/paths.py is a leaf module: loaded by file, each process starts in milliseconds, and
    # all four wait for one common start time.
    code = ("import contextlib, importlib.util, os, sys, time\n"
            f"spec = importlib.util.spec_from_file_location('paths', {str(PATHS_PY)!r})\n"
            "paths = importlib.util.module_from_spec(spec); spec.loader.exec_module(paths)\n"
            "lock = contextlib.nullcontext() if sys.argv[1] == 'broken' else paths.cache_lock('t')\n"
            "time.sleep(max(0.0, float(sys.argv[3]) - time.time()))\n"
            "with lock:\n"
            "    with open(sys.argv[2], 'a') as f: f.write(f'start {os.getpid()}\\n')\n"
            "    time.sleep(0.3)\n"
            "    with open(sys.argv[2], 'a') as f: f.write(f'end {os.getpid()}\\n')\n")
    env = dict(os.environ, JSPEC_CACHE=str(tmp_path / "cache"))

    def run(mode):
        log.write_text("")
        start = str(time.time() + 2.0)
        procs = [subprocess.Popen([sys.executable, "-c", code, mode, str(log), start], env=env)
                 for _ in range(4)]
        assert all(p.wait(timeout=120) == 0 for p in procs)
        lines = log.read_text().split()
        return [(lines[i], lines[i + 1]) for i in range(0, len(lines), 2)]

    pairs = run("locked")
    assert len(pairs) == 8
    assert all(pairs[i][0] == "start" and pairs[i + 1] == ("end", pairs[i][1])
               for i in range(0, 8, 2))
    pairs = run("broken")
    assert not all(pairs[i][0] == "start" and pairs[i + 1] == ("end", pairs[i][1])
                   for i in range(0, 8, 2))


def test_converted_entry_gets_the_umask_mode_not_a_private_one(tmp_path, monkeypatch):
    """A registry model converted into the cache is readable as the umask allows (0755 under
    022), not left at the 0700 of the temporary directory it was written in (the bug: a cache
    shared by several users was unreadable to all but the first)."""
    from jspec.models import registry

    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, random_model("llama_tied_gqa2").config,
               random_model("llama_tied_gqa2").weights)
    entry = registry.RegistryEntry(name="tiny-entry", package="none", module="none",
                                   member="none/tiny.gguf", wheel_sha256="",
                                   gguf_sha256=registry.sha256(gguf_path), description="")
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "fetch_gguf", lambda e, **kw: gguf_path)
    old = os.umask(0o022)
    try:
        out = registry.converted_dir(entry)
    finally:
        os.umask(old)
    assert out == tmp_path / "cache" / "models" / "tiny-entry"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert (out / "config.json").is_file() and (out / ".jspec-converted").is_file()
    assert [p.name for p in out.parent.iterdir()] == ["tiny-entry"]  # no temporary left
    assert registry.converted_dir(entry) == out  # converted once: the marker is read
