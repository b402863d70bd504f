"""`python -m jspec aot` flops: the matmuls counted in the compiled HLO walk (jspec/aot/hlo.py),
a while body (scanned layers) once per trip. `cost_analysis()["flops"]` counts it once."""

from __future__ import annotations

import json

import pytest
from conftest import needs_libtpu

from jspec.aot.hlo import hbm_traffic

# A while loop of 3 trips whose body runs a fusion with a dot [4,8]x[8,16] (nested in a fusion)
# and a 1x1 convolution [2,5,8]x[1,8,6]; a conditional whose branches differ; an entry dot and
# a projection as the TPU compiler writes some ([2,8] x [8, 4*3] as a window of 4 over 1 input
# position padded by 3 each side: each output position reads the input once, not 4 times).
HLO = """HloModule m

%inner (a: f32[4,8], b: f32[8,16]) -> f32[4,16] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%outer (p0: f32[4,8], p1: f32[8,16], p2: f32[2,5,8], p3: f32[1,8,6]) -> f32[2,5,6] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,16]{1,0} parameter(1)
  %p2 = f32[2,5,8]{2,1,0:T(8,128)} parameter(2)
  %p3 = f32[1,8,6]{2,1,0} parameter(3)
  %fusion.9 = f32[4,16]{1,0} fusion(%p0, %p1), kind=kOutput, calls=%inner
  ROOT %conv = f32[2,5,6]{2,1,0} convolution(%p2, %p3), window={size=1}, dim_labels=0bf_0io->0bf
}

%body (t: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %t = (s32[], f32[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%t), index=1
  %w = f32[8,16]{1,0} constant({...})
  %k = f32[2,5,8]{2,1,0} constant({...})
  %c = f32[1,8,6]{2,1,0} constant({...})
  %f = f32[2,5,6]{2,1,0} fusion(%x, %w, %k, %c), kind=kOutput, calls=%outer
  ROOT %r = (s32[], f32[4,8]) tuple(%i, %x)
}

%cond (t: (s32[], f32[4,8])) -> pred[] {
  %t = (s32[], f32[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%small (x: f32[4,8]) -> f32[4,4] {
  %x = f32[4,8]{1,0} parameter(0)
  %y = f32[8,4]{1,0} constant({...})
  ROOT %dot.2 = f32[4,4]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%large (x: f32[4,8]) -> f32[4,16] {
  %x = f32[4,8]{1,0} parameter(0)
  %y = f32[4,16,8]{2,1,0} constant({...})
  ROOT %d3 = f32[4,16] dot(%x, %y), lhs_batch_dims={0}, lhs_contracting_dims={1}, rhs_contracting_dims={2}
}

ENTRY %main (x: f32[4,8], p: s32[]) -> f32[4,8] {
  %x = f32[4,8]{1,0} parameter(0)
  %p = s32[] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8]) tuple(%zero, %x)
  %loop = (s32[], f32[4,8]) while(%init), condition=%cond, body=%body
  %branch = f32[4,16]{1,0} conditional(%p, %x, %x), branch_computations={%small, %large}
  %w = f32[8,8]{1,0} constant({...})
  %dot.4 = f32[4,8]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %h = f32[2,8,1]{2,1,0} constant({...})
  %q = f32[4,3,8]{2,1,0} constant({...})
  %pj = f32[2,4,3] convolution(%h, %q), window={size=4 pad=3_3 rhs_reversal=1}, dim_labels=bf0_0oi->b0f
  ROOT %r = f32[4,8]{1,0} add(%dot.4, %dot.4)
}
"""


def test_hlo_flops_count_matmuls_per_loop_trip():
    """Dots and convolutions (2 x output x contracted), inside nested fusions, a while body per
    trip, a conditional's costlier branch, the entry's own dot."""
    body = 2 * 4 * 16 * 8 + 2 * (2 * 5 * 6) * (1 * 8)  # the fused dot + the 1x1 convolution
    branch = 2 * (4 * 16) * 8  # the larger branch (a batched dot), not 2 * (4 * 4) * 8
    entry = 2 * 4 * 8 * 8 + 2 * (2 * 3 * 4) * 8  # the padded window: 8 per output, not 32
    assert hbm_traffic(HLO)["flops"] == 3 * body + branch + entry


BASE = {"model_type": "llama", "vocab_size": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "max_position_embeddings": 4096}
SMALL = BASE | {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 3,
                "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}
# 4 heads of 128 per chip: at T = 1 the compiler writes the Q projection as a padded window.
WIDE = BASE | {"hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 2,
               "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}


@needs_libtpu()
@pytest.mark.parametrize(("hf", "t"), [(SMALL, 4), (WIDE, 1)], ids=["small-T4", "wide-T1"])
def test_scanned_and_unrolled_flops_agree_and_match_the_params(tmp_path, hf, t):
    """A small model's forward compiled for 8 v5e chips: the scanned layers (an HLO while loop)
    and the unrolled ones count the same matmul flops, 2 x matmul params x tokens per chip
    (attention's own matmuls are in the Mosaic kernel: not counted). Control, for SMALL: the
    unrolled count is near the cost analysis's (its extra: elementwise work); for WIDE the
    cost analysis is no control: it says 13 MFLOP unrolled for the 71 counted here and
    analytically."""
    from jspec.aot.report import model_config, setup, step_program

    p = tmp_path / "config.json"
    p.write_text(json.dumps(hf))
    batch = 8
    got = {}
    for scan in (True, False):
        s = setup(model_config(str(p)), "v5e:2x4", batch=batch, context=512, scan_layers=scan)
        c = step_program(s, t)
        assert c.ok, c.error
        got[scan] = c
    cfg = s.config  # KV heads repeated to the model axis (8), as compiled
    h, hd = cfg.hidden_size, cfg.head_dim
    layer = h * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * h * cfg.ffn_size
    analytic = 2 * (cfg.num_layers * layer + h * cfg.vocab_size) * batch * t / s.mesh.size
    scanned, unrolled = got[True].flops, got[False].flops
    assert scanned == pytest.approx(unrolled, rel=0.02)
    assert scanned == pytest.approx(analytic, rel=0.02)
    if hf is SMALL:
        assert unrolled == pytest.approx(got[False].flops_cost_analysis, rel=0.05)
