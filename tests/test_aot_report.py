"""`python -m jspec aot`: the TPU report, compiled here with libtpu (fast shapes; 8B / 70B are
`-m slow`)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

if importlib.util.find_spec("libtpu") is None:
    if os.environ.get("CI"):
        raise RuntimeError("libtpu is missing: .ci/run installs the 'tpu' extra")
    pytest.skip("libtpu not installed (pip install -e '.[tpu]')", allow_module_level=True)

from jspec.aot import CHIPS, model_config, report, table
from jspec.cli import main
from jspec.errors import JspecError

SMALL = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1024,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
         "head_dim": 64, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False, "max_position_embeddings": 4096}


@pytest.fixture
def small_config(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(SMALL))
    return str(p)


def test_report_small_model_on_one_chip(small_config):
    rep = report(small_config, "v5e:1x1", batch=2, context=1024, nodes=(1, 4, 16), trees=True)
    rows = {(r["t"], r["tree"]): r for r in rep["programs"]}
    assert set(rows) == {(1, False), (4, False), (16, False), (4, True), (16, True)}
    assert all(r["ok"] and r["fits"] for r in rows.values())
    # The weights are the arguments: 2 layers of bf16 matrices + embeddings + head.
    w = 2 * (2048 * 512 * 2) + 2 * 2 * (512 * 512 + 2 * 512 * 128 + 512 * 512 + 3 * 512 * 1024)
    assert abs(rep["weights_bytes_per_chip"] - w) < 0.01 * w
    ar = rows[(1, False)]
    # A step reads its weights and live cache about once (HBM bytes modelled from the HLO).
    assert 0.95 <= rep["ar_bytes_over_floor"] <= 1.5
    assert ar["hbm_bytes_read"] >= 0.95 * rep["byte_floor_per_chip"]
    assert ar["mosaic_calls"] > 0  # attention "auto" on TPU: the Mosaic kernel
    # 16 tokens cost about an AR step or more (at these toy sizes XLA places the scanned
    # stack's slices in VMEM differently per program: within 5%).
    assert rows[(16, False)]["c_modelled"] >= 0.95
    assert rep["largest_batch_at_context"] >= 2
    text = table(rep)
    assert "MODELLED" in text and "chain forward T=16" in text


def test_cli_writes_json_and_refuses_unknown_inputs(small_config, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["aot", "--model", small_config, "--topology", "v5e:1x1", "--nodes", "2",
                 "--no-trees", "--context", "512", "--rounds", "eagle3 chain K4 T0",
                 "--prompt", "64", "--new-tokens", "16", "--json-out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [r["t"] for r in rep["programs"]] == [1, 2]
    (rnd,) = rep["rounds"]  # one EAGLE-3 round: its verify forward (T = 5) plus drafting
    assert rnd["ok"] and rnd["modelled_s"] > rnd["verify_forward_modelled_s"] > 0
    assert rnd["besides_forward_over_ar_step"] > 0
    assert rep["chip"]["hbm_bytes"] == CHIPS["v5e"].hbm_bytes
    assert main(["aot", "--model", "no-such-model", "--topology", "v5e:1x1"]) == 2
    assert "no model" in capsys.readouterr().err
    with pytest.raises(JspecError, match="generation"):
        report(small_config, "v9z:1x1")


def test_shipped_architectures_parse():
    c = model_config("llama-3.1-8b")
    assert (c.num_layers, c.hidden_size, c.num_kv_heads, c.vocab_size) == (32, 4096, 8, 128256)
    assert model_config("qwen3-8b").qk_norm
    assert model_config("llama-3.1-70b").num_layers == 80


@pytest.mark.slow
def test_llama_8b_on_v5e_2x4_fits_and_reads_near_its_floor():
    rep = report("llama-3.1-8b", "v5e:2x4", batch=8, context=4096, nodes=(1, 17), trees=False)
    assert all(r["ok"] and r["fits"] for r in rep["programs"])
    assert rep["ar_bytes_over_floor"] < 2.0


@pytest.mark.slow
def test_llama_70b_compiles_on_16_chips_over_4_hosts():
    rep = report("llama-3.1-70b", "v5e:4x4", batch=1, context=4096, nodes=(1,), trees=False)
    assert rep["chips"] == 16 and all(r["ok"] and r["fits"] for r in rep["programs"])


HLO = """HloModule m

%fused_computation.1 (param_0: u16[8,4096], param_1: s32[]) -> u16[1,4096] {
  %param_0 = u16[8,4096]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  ROOT %dynamic-slice.1 = u16[1,4096]{1,0} dynamic-slice(%param_0, %param_1), dynamic_slice_sizes={1,4096}
}

%fused_computation.2 (param_0: u16[8,4096], param_1: u16[1,4096]) -> u16[8,4096] {
  %param_0 = u16[8,4096]{1,0} parameter(0)
  %param_1 = u16[1,4096]{1,0} parameter(1)
  %c = s32[] constant(0)
  ROOT %dus = u16[8,4096]{1,0} dynamic-update-slice(%param_0, %param_1, %c, %c)
}

ENTRY %main (p0: bf16[1024,1024], p1: u16[8,4096], p2: s32[]) -> u16[8,4096] {
  %p0 = bf16[1024,1024]{1,0} parameter(0)
  %p1 = u16[8,4096]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %slice-start = ((bf16[1024,1024]{1,0}), bf16[256,1024]{1,0:S(1)}, s32[]{:S(2)}) slice-start(%p0), slice={[0:256], [0:1024]}
  %slice-done = bf16[256,1024]{1,0:S(1)} slice-done(%slice-start)
  %use = f32[256]{0:S(1)} fusion(%slice-done), kind=kLoop, calls=%nothing
  %row = u16[1,4096]{1,0:S(1)} fusion(%p1, %p2), kind=kLoop, calls=%fused_computation.1
  ROOT %upd = u16[8,4096]{1,0} fusion(%p1, %row), kind=kLoop, calls=%fused_computation.2
}
"""


def test_hlo_traffic_model():
    """HBM bytes from an HLO text: a VMEM slice counts as its slice, VMEM operands are free,
    an operand read through a dynamic-slice counts as the window, a DUS-rooted fusion moves only
    its update (in place)."""
    from jspec.aot.hlo import hbm_traffic

    r = hbm_traffic(HLO)
    slice_bytes, row = 256 * 1024 * 2, 4096 * 2
    # the slice, the window and its 4-byte index (the update was in VMEM)
    assert r["hbm_read_bytes"] == slice_bytes + row + 4
    assert r["hbm_written_bytes"] == row  # only the updated row, in place


def test_generate_compiles_for_tpu_with_every_drafter_kind(small_config):
    """`generate` in a jit with each drafter kind (n-gram, EAGLE-3 chain and drawn tree,
    DFlash, LibraSpec, early exit, ASD) compiles for a v5e chip with default options."""
    from jspec.aot.programs import CASES, generate_program
    from jspec.aot.report import setup

    s = setup(model_config(small_config), "v5e:1x1", batch=2, context=512)
    for case in CASES:
        c = generate_program(s, case, prompt=64, new_tokens=16)
        assert c.ok, (case.name, c.error)
        assert c.mosaic_calls > 0 and c.hbm_bytes > 0, case.name


@pytest.mark.slow
def test_llama_8b_generate_every_drafter_on_v6e():
    from jspec.aot.programs import CASES, generate_program
    from jspec.aot.report import setup

    s = setup(model_config("llama-3.1-8b"), "v6e:1x1", batch=8, context=1024)
    for case in CASES:
        c = generate_program(s, case, prompt=512, new_tokens=128)
        assert c.ok and c.hbm_bytes < 32 * 2**30, (case.name, c.error)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_training_step_compiles_for_8_chips(small_config, kind):
    from jspec.aot.report import setup
    from train.aot import train_step_program

    c = train_step_program(setup(model_config(small_config), "v5e:2x4", 1, 128), kind, rows=8,
                           seq=256)
    assert c.ok and c.hbm_bytes > 0, c.error


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_llama_8b_training_step_fits_v5e_2x4(kind):
    from jspec.aot.report import setup
    from train.aot import train_step_program

    c = train_step_program(setup(model_config("llama-3.1-8b"), "v5e:2x4", 1, 128), kind)
    assert c.ok and c.hbm_bytes < 16 * 2**30, c.error
