"""scripts/hlo_kernels.py: kernels per decode step from compiled HLO text.
A hand-written module with known counts (fusions whose computations are
not kernels, a cuBLAS custom-call, free instructions, a nested while and a
conditional counted apart, a command buffer followed, async pairs, quoted
text that looks like attributes), then the generate programs of the tiny
model: "blockwise" attention has one loop per attention layer of a round
(the backbone's, plus one per drafting MTP module), "dense" none."""

import re

import numpy as np
import pytest

from scripts import hlo_kernels as hk

HLO = """\
HloModule jit_generate, is_scheduled=true, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_add (p0: f32[4], p1: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  %a = f32[4]{0} add(%p0, %p1)
  %m = f32[4]{0} multiply(%a, %a)
  ROOT %e = f32[4]{0} exponential(%m)
}

inner_body {
  %ib.p = (s32[], f32[4]{0}) parameter(0)
  %ib.i = s32[] get-tuple-element(%ib.p), index=0
  %ib.x = f32[4]{0} get-tuple-element(%ib.p), index=1
  %ib.f = f32[4]{0} fusion(%ib.x, %ib.x), kind=kLoop, calls=%fused_add
  %ib.one = s32[] constant(1)
  %ib.n = s32[] add(%ib.i, %ib.one)
  ROOT %ib.t = (s32[], f32[4]{0}) tuple(%ib.n, %ib.f)
}

%inner_cond (ic.p: (s32[], f32[4])) -> pred[] {
  %ic.p = (s32[], f32[4]{0}) parameter(0)
  %ic.i = s32[] get-tuple-element(%ic.p), index=0
  %ic.k = s32[] constant(3)
  ROOT %ic.lt = pred[] compare(%ic.i, %ic.k), direction=LT
}

%branch_a (ba.p: f32[4]) -> f32[4] {
  %ba.p = f32[4]{0} parameter(0)
  ROOT %ba.n = f32[4]{0} negate(%ba.p)
}

%branch_b (bb.p: f32[4]) -> f32[4] {
  ROOT %bb.p = f32[4]{0} parameter(0)
}

%command_buffer.1 (cb.p: f32[4]) -> f32[4] {
  %cb.p = f32[4]{0} parameter(0)
  %cb.f1 = f32[4]{0} fusion(%cb.p, %cb.p), kind=kLoop, calls=%fused_add
  ROOT %cb.f2 = f32[4]{0} fusion(%cb.f1, %cb.f1), kind=kLoop, calls=%fused_add
}

%outer_body (ob.p: (s32[], f32[4], pred[])) -> (s32[], f32[4], pred[]) {
  %ob.p = (s32[], f32[4]{0}, pred[]) parameter(0)
  %ob.i = s32[] get-tuple-element(%ob.p), index=0
  %ob.x = f32[4]{0} get-tuple-element(%ob.p), index=1
  %ob.b = pred[] get-tuple-element(%ob.p), index=2
  %ob.f = f32[4]{0} fusion(%ob.x, %ob.x), kind=kLoop, calls=%fused_add, metadata={op_name="jit(generate)/while/body=%fake_body calls=%fused_add"}
  %ob.g = f32[2,2]{1,0:T(2,128)} bitcast(%ob.f)
  %ob.mm = (f32[2,2]{1,0}, s8[64]{0}) custom-call(%ob.g, %ob.g), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1}}
  %ob.mmr = f32[2,2]{1,0} get-tuple-element(%ob.mm), index=0
  %ob.cs = (f32[2,2]{1,0}, f32[2,2]{1,0}, u32[]) copy-start(%ob.mmr)
  %ob.cd = f32[2,2]{1,0} copy-done(%ob.cs)
  %ob.c = f32[4]{0} bitcast(%ob.cd)
  %ob.zero = s32[] constant(0)
  %ob.t = (s32[], /*index=1*/f32[4]{0}) tuple(%ob.zero, %ob.c)
  %ob.w = (s32[], f32[4]{0}) while(%ob.t), condition=%inner_cond, body=%inner_body
  %ob.wx = f32[4]{0} get-tuple-element(%ob.w), index=1
  %ob.k = (s32[], f32[4]{0}) while(%ob.t), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  %ob.cond = f32[4]{0} conditional(%ob.b, %ob.wx, %ob.wx), true_computation=%branch_a, false_computation=%branch_b
  %ob.cb = f32[4]{0} call(%ob.cond), to_apply=%command_buffer.1
  %ob.one = s32[] constant(1)
  %ob.n = s32[] add(%ob.i, %ob.one)
  ROOT %ob.r = (s32[], f32[4]{0}, pred[]) tuple(%ob.n, %ob.cb, %ob.b)
}

%outer_cond (oc.p: (s32[], f32[4], pred[])) -> pred[] {
  %oc.p = (s32[], f32[4]{0}, pred[]) parameter(0)
  %oc.i = s32[] get-tuple-element(%oc.p), index=0
  %oc.k = s32[] constant(10)
  ROOT %oc.lt = pred[] compare(%oc.i, %oc.k), direction=LT
}

ENTRY %main.9 (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %pre = f32[4]{0} fusion(%x, %x), kind=kLoop, calls=%fused_add
  %z = s32[] constant(0)
  %f = pred[] constant(false)
  %t = (s32[], f32[4]{0}, pred[]) tuple(%z, %pre, %f)
  %w = (s32[], f32[4]{0}, pred[]) while(%t), condition=%outer_cond, body=%outer_body
  ROOT %out = f32[4]{0} get-tuple-element(%w), index=1
}

FileNames
1 "decode/loops.py"
StackFrames
1 {file_location_id=1 parent_frame_id=1}
"""


def test_hand_written_module_known_counts():
  """The outer body: fusion, custom-call, copy-start, call -> 2 fusions of
  the command buffer, add = 6 kernels; the fusion's computation (3 ops), the
  free instructions (parameter, gte, constant, tuple, bitcast, copy-done)
  and the quoted "body=%fake_body" count nothing; 2 nested whiles (one of
  known trip count) and 1 conditional counted apart, their kernels (inner
  body: fusion + add, inner condition: compare, per loop; branch: negate)
  as nested kernels."""
  r = hk.kernels_per_step(HLO)
  assert r["scope"] == "outer_body"
  assert r["kernels"] == 6
  assert r["by_opcode"] == {"add": 1, "copy-start": 1, "custom-call": 1, "fusion": 3}
  assert r["custom_calls"] == {"__cublas$gemm": 1}
  assert (r["nested_whiles"], r["nested_whiles_known_trip_count"], r["conditionals"]) == (2, 1, 1)
  assert r["nested_kernels"] == 2 * 3 + 1
  assert r["condition_kernels"] == 1 and r["command_buffers"] == 1
  assert hk.summary(r) == "6 (2 loops, 1 cond)"


def test_counts_move_with_the_text():
  """One more fusion in the body is one more kernel; one in a fused
  computation is none; a program without a while is counted whole (its
  ENTRY); text without ENTRY is refused."""
  extra = HLO.replace("  %ob.one = s32[] constant(1)\n",
                      "  %ob.one = s32[] constant(1)\n"
                      "  %ob.e = f32[4]{0} fusion(%ob.cb, %ob.cb), kind=kLoop, calls=%fused_add\n")
  assert hk.kernels_per_step(extra)["kernels"] == 7
  inner = HLO.replace("  ROOT %e = f32[4]{0} exponential(%m)",
                      "  %e0 = f32[4]{0} exponential(%m)\n  ROOT %e = f32[4]{0} negate(%e0)")
  assert hk.kernels_per_step(inner)["kernels"] == 6
  flat = HLO.replace("  %w = (s32[], f32[4]{0}, pred[]) while(%t), condition=%outer_cond, "
                     "body=%outer_body\n  ROOT %out = f32[4]{0} get-tuple-element(%w), index=1",
                     "  ROOT %out = f32[4]{0} fusion(%pre, %pre), kind=kLoop, calls=%fused_add")
  r = hk.kernels_per_step(flat)
  assert (r["scope"], r["kernels"], r["nested_whiles"]) == ("main.9", 2, 0)
  with pytest.raises(ValueError, match="no ENTRY"):
    hk.kernels_per_step(HLO.replace("ENTRY ", ""))


def test_instruction_parsing_edge_cases():
  """Tuple types with index comments, TPU layouts with parentheses, ROOT,
  branch_computations lists."""
  i = hk.parse_instruction("  ROOT %r.1 = (s32[], /*index=1*/f32[1,128]{1,0:T(8,128)}) "
                           "conditional(%p, %a, %b), branch_computations={%b0, %b1.2}")
  assert (i.name, i.opcode, i.calls) == ("r.1", "conditional",
                                         {"branch_computations": ["b0", "b1.2"]})
  i = hk.parse_instruction("  %d = f32[2]{0:T(256)} dynamic-update-slice(%x, %y, %z)")
  assert i.opcode == "dynamic-update-slice"
  assert hk.parse_instruction("1 {file_location_id=1 parent_frame_id=1}") is None
  assert hk.parse_instruction("HloModule m, entry_computation_layout={()->f32[]}") is None


# -- the tiny model's generate programs ------------------------------------------------------

G = 2


@pytest.fixture(scope="module")
def programs():
  """{(impl, method): (kernels_per_step, count of "while(" in the compiled
  text)} for the tiny model (2 layers, D = 2) at B = 1: AR and MTP G = 2
  (compiled once each, ~3 s)."""
  from decode.sampling import SamplingParams
  from decode.decoder import Decoder
  from mtp import model as model_lib
  from mtp import tokenizer as tok
  from tests.conftest import tiny_config
  out = {}
  prompt = np.asarray([tok.BOS_ID, 100, 101, 102], np.int32)
  for impl in ("blockwise", "dense"):
    cfg = tiny_config(model=dict(attention_impl=impl), mtp=dict(depth=2))
    model = model_lib.build_model(cfg)
    for method in ("ar", "mtp"):
      d = Decoder(model, method, G)
      state, prefill_len = d.prepare([prompt], 8, 0)
      _, generate = d.lowered(state, prefill_len, SamplingParams(temperature=0.0))
      text = generate.compile().as_text()
      out[impl, method] = (hk.kernels_per_step(text), len(re.findall(r"\bwhile\(", text)),
                           cfg.model.num_layers)
  return out


def test_blockwise_has_a_loop_per_attention_layer_and_dense_none(programs):
  """"blockwise": the AR step's nested whiles are the backbone's layers
  (its fori_loop per layer), an MTP G = 2 round's those plus one per
  drafting module (modules 1 and 2, one attention layer each), none of a
  known trip count; "dense": none. Every step launches kernels; the outer
  loop is the only other while in the program."""
  for (impl, method), (r, whiles, layers) in programs.items():
    assert r["kernels"] > 0 and r["condition_kernels"] >= 1, (impl, method, r)
    assert r["nested_whiles"] + 1 == whiles, (impl, method, r, whiles)
    assert r["conditionals"] == 0, (impl, method, r)
    if impl == "dense":
      assert r["nested_whiles"] == 0 and r["nested_kernels"] == 0, (impl, method, r)
    else:
      want = layers + (G if method == "mtp" else 0)
      assert r["nested_whiles"] == want, (impl, method, r)
      assert r["nested_whiles_known_trip_count"] == 0 and r["nested_kernels"] > 0
  for impl in ("blockwise", "dense"):     # a round drafts and verifies: more work than a step
    assert programs[impl, "mtp"][0]["kernels"] > programs[impl, "ar"][0]["kernels"]


def test_device_check_reports_the_count():
  """scripts/device_check.py's decode part: the counts of a dtype's
  decoders go into its rows (``annotate_kernels``) and the markdown's
  "kernels / step" column; a decoder not counted shows "-"."""
  from scripts import device_check as dc
  counts = {"float32": {"ar": hk.kernels_per_step(HLO), "mtp_G1": {"error": "X: y"}}}
  row = dict(batch_size=1, temperature=0.0, tokens_per_s=10.0, speedup=1.0, speedup_decode=1.0,
             tau=1.0, identical_to_ar=None)
  rec = {"status": "ok", "rows": [dict(row, label="ar", dtype="float32"),
                                  dict(row, label="mtp_G1", dtype="float32"),
                                  dict(row, label="ar", dtype="bfloat16")], "kernels": counts}
  dc.annotate_kernels(rec)
  assert [(r["kernels_per_step"], r["loops_per_step"]) for r in rec["rows"]] == \
      [(6, 2), (None, None), (None, None)]
  md = dc.markdown({}, {"device": {}, "parts": {"decode": rec}})
  assert "| greedy = AR | kernels / step |" in md
  cells = [line.rsplit("|", 2)[-2].strip() for line in md.splitlines() if line.startswith("| 1 |")]
  assert cells == ["6 (2 loops, 1 cond)", "error", "-"]
