"""The numeric contract's near-tie report (``decode.cli.compare.near_tie``,
``greedy_check``; docs/speculative_sampling.md, "Numeric contract"): where
greedy outputs of a method and of AR differ, the target's top-2 logit gap at
the first differing token against the bound for the decode dtype; below it a
near-tie, at or above it a bug. The bound itself is checked against the
logits of several computations of a tiny model (cache sizes, attention
implementations, verify blocks, the cache-free forward), in float32 and
bfloat16."""

import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from decode.cli import compare as compare_lib
from decode import acceptance as verify
from decode.decoder import Decoder, SamplingParams
from decode.cli.texts import encode_prompts
from mtp import loading
from mtp import model as model_lib
from tests.conftest import random_prompts, tiny_config

GREEDY = SamplingParams(temperature=0.0)
U32, U16 = 2.0 ** -24, 2.0 ** -8


# -- the pure function -------------------------------------------------------------

def test_bounds_are_the_documented_formulas():
  """D = 4 L u sqrt(n) scale in float32 (u = 2^-24; the logit scale ||h||
  max ||W_v||), 8 ulps of the largest logit in bfloat16 (16 u |z|_max,
  u = 2^-8, whatever L, n and scale); the near-tie bound is 2 D; another
  dtype has no contract."""
  f = compare_lib.logit_error_bound
  d32 = f("float32", scale=8.0, layers=2, length=60, max_logit=3.0)
  assert d32 == pytest.approx(4 * 2 * U32 * math.sqrt(60) * 8.0)
  assert f("float32", scale=16.0, layers=30, length=60, max_logit=99.0) == pytest.approx(d32 * 30)
  d16 = f("bfloat16", scale=8.0, layers=2, length=60, max_logit=-3.0)
  assert d16 == pytest.approx(16 * U16 * 3.0) == 0.1875
  assert f("bfloat16", scale=1.0, layers=30, length=5, max_logit=3.0) == d16
  r = compare_lib.near_tie(np.array([3.0, -2.0, -np.inf]), dtype="float32", scale=8.0, layers=2,
                           length=60)
  assert r["bound"] == pytest.approx(2 * d32) and r["max_logit"] == 3.0
  r = compare_lib.near_tie(np.array([1.0, -3.0, -np.inf]), dtype="bfloat16", scale=8.0,
                           layers=2, length=60)
  assert r["bound"] == pytest.approx(2 * d16)
  with pytest.raises(ValueError, match="dtype='int8'"):
    f("int8", scale=1.0, layers=1, length=1, max_logit=1.0)


def test_near_tie_and_bug_verdicts():
  """The gap is top-1 minus top-2 over finite logits (-inf ids left out);
  a gap under the bound is a near-tie, at or over it a bug, each with its
  printed line."""
  kw = dict(dtype="bfloat16", scale=4.0, layers=2, length=10)
  bound = 2 * 16 * U16 * 3.0                          # 0.375: 16 ulps of 3.0
  z = np.array([-np.inf, 1.0, 3.0, 3.0 - 0.01, np.nan])
  r = compare_lib.near_tie(z, **kw)
  assert r["top2_ids"] == [2, 3] and r["gap"] == pytest.approx(0.01)
  assert r["near_tie"] and r["bound"] == pytest.approx(bound)
  assert r["line"] == "near-tie: top-2 gap 0.01 < bound 0.375 (bfloat16)"
  r = compare_lib.near_tie(np.array([0.5, 3.0, 3.0 - bound]), **kw)     # exactly the bound
  assert not r["near_tie"]
  assert r["line"] == ("greedy outputs differ at a top-2 gap 0.375 >= bound 0.375 (bfloat16): "
                       "a bug")
  tie = compare_lib.near_tie(np.array([2.0, 2.0, 1.0]), **kw)           # an exact tie
  assert tie["near_tie"] and tie["gap"] == 0 and tie["top2_ids"] == [0, 1]
  f32 = compare_lib.near_tie(np.array([3.0, 3.0 - 0.01]), dtype="float32", scale=4.0, layers=2,
                             length=10)
  assert not f32["near_tie"] and f32["line"].endswith("(float32): a bug")  # 0.01 is no f32 tie


def test_first_difference():
  f = compare_lib.first_difference
  assert f([1, 2, 3], [1, 2, 3]) is None
  assert f([1, 2, 3], [1, 5, 3]) == 1 and f([4], [5]) == 0
  assert f([1, 2], [1, 2, 3]) == 2 and f([1, 2, 3], [1]) == 1
  assert f([], []) is None and f([], [7]) == 0


# -- the bound against measured logits of a tiny model -----------------------------

PROMPT, TOTAL = 12, 40


def _cached_logits(model, cfg, tokens, cache_slots: int, step: int) -> np.ndarray:
  """Logits at positions PROMPT-1 .. TOTAL-1 from a prefill of PROMPT tokens
  and cached calls of ``step`` tokens (1: AR steps; 3: verify blocks of
  G + 1 = 3), teacher-forced along ``tokens``."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def call(state, toks, pos, cache):
    m = nnx.merge(graphdef, state)
    h, cache = m.backbone(toks, pos, cache=cache)
    return m.head(h), cache
  b = tokens.shape[0]
  cache = model_lib.init_layer_caches(cfg.model, cfg.model.num_layers, b, cache_slots)
  pos = jnp.broadcast_to(jnp.arange(PROMPT, dtype=jnp.int32), (b, PROMPT))
  logits, cache = call(state, tokens[:, :PROMPT], pos, cache)
  out, i = [logits[:, -1:]], PROMPT
  while i < TOTAL:
    n = min(step, TOTAL - i)
    pos = jnp.broadcast_to(jnp.arange(i, i + n, dtype=jnp.int32), (b, n))
    logits, cache = call(state, tokens[:, i:i + n], pos, cache)
    out.append(logits)
    i += n
  return np.asarray(jnp.concatenate(out, 1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_contract_bound_covers_every_computation_of_the_logits(dtype):
  """The logits of one tiny model computed four ways (AR steps with 64
  cache slots, "blockwise"; verify blocks of 3 tokens with 256 slots,
  "dense"; AR steps with 256 slots, "dense"; the cache-free forward) differ
  pairwise by at most the contract's D at every position (per position:
  its own scale ||h|| max ||W_v||, largest logit and prefix length); and
  by more than D / 64, so the bound is not vacuous slack on this model
  (measured on this CPU: float32 up to 7 u scale against D = 4 L u sqrt(n)
  scale, about 50 u scale; bfloat16 up to 5.8 u |z|_max against 16 u
  |z|_max)."""
  cfg32 = tiny_config(model=dict(max_seq_len=512), mtp=dict(depth=0))
  cfg, model = loading.override_model(cfg32, model_lib.build_model(cfg32, seed=1), dtype=dtype)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, TOTAL)), jnp.int32)
  out = model(tokens)
  free = np.asarray(out.logits)[:, PROMPT - 1:]
  hn = model.final_norm(out.hidden[0]).astype(jnp.float32)
  w = float(jnp.linalg.norm(model.embed.embedding[...].astype(jnp.float32), axis=-1).max())
  scale = np.asarray(jnp.linalg.norm(hn, axis=-1))[:, PROMPT - 1:] * w
  runs = [free]
  for impl, slots, step in (("blockwise", 64, 1), ("dense", 256, 3), ("dense", 256, 1)):
    c, m = loading.override_model(cfg, model, attention_impl=impl)
    runs.append(_cached_logits(m, c, tokens, slots, step))
  finite = np.isfinite(free)
  lengths = np.arange(PROMPT, TOTAL + 1)[None, :]
  max_logit = np.abs(np.where(finite, free, 0.0)).max(-1)
  bound = np.vectorize(lambda s, n, z: compare_lib.logit_error_bound(
      dtype, scale=float(s), layers=cfg.model.num_layers, length=int(n), max_logit=float(z)))(
          scale, lengths, max_logit)
  worst = 0.0
  for i, a in enumerate(runs):
    for b in runs[i + 1:]:
      np.testing.assert_array_equal(np.isfinite(b), finite)
      diff = np.abs(np.where(finite, a, 0.0) - np.where(finite, b, 0.0)).max(-1)
      assert (diff <= bound).all(), (dtype, float((diff / bound).max()))
      worst = max(worst, float((diff / bound).max()))
  assert worst > 1 / 64, worst


# -- greedy_check on a model built to tie in bfloat16 -----------------------------

@pytest.fixture(scope="module")
def built_tie():
  """A tiny float32 model in which id b's output row is id a's times
  (1 - 2^-10), a the id its greedy AR emits most: where a leads with
  z_a > 0, b is second, 2^-10 z_a behind, far above float32's bound, while
  in bfloat16 the two rows round to (nearly) the same weights and the two
  logits are equal up to bfloat16 rounding. Returns (cfg, model, prompts,
  a, b)."""
  cfg = tiny_config(mtp=dict(depth=1))
  model = model_lib.build_model(cfg, seed=5)
  prompts = random_prompts([6, 10], seed=3)
  gen = Decoder(model, "ar").generate(prompts, 16, GREEDY)
  emitted = np.concatenate(gen.tokens)
  a = int(np.bincount(emitted).argmax())
  used = set(emitted.tolist()) | set(np.concatenate(prompts).tolist())
  b = next(i for i in b"QXZJKV" if i not in used and i != a)
  e = model.embed.embedding[...]
  model.embed.embedding[...] = e.at[b].set(e[a] * (1 - 2.0 ** -10))
  return cfg, model, prompts, a, b


def _swap_first(tokens, pair):
  """A copy of rows ``tokens`` where the first token in ``pair`` (in any
  row) is replaced by the other one of the pair, and the row cut after it
  (what a flip at a tie looks like). Returns (rows, (row, index))."""
  a, b = pair
  for r, row in enumerate(tokens):
    hits = np.flatnonzero(np.isin(row, pair))
    if hits.size:
      i = int(hits[0])
      new = np.array(row[:i + 1])
      new[i] = b if row[i] == a else a
      rows = [np.array(t) for t in tokens]
      rows[r] = new
      return rows, (r, i)
  raise AssertionError(f"no token of {pair} emitted")


def test_a_flip_at_the_built_tie_is_a_near_tie_in_bfloat16(built_tie):
  """In bfloat16 a greedy output that took b where AR took a (or the
  reverse) at the built tie is reported as a near-tie: the position, both
  tokens, the top-2 ids {a, b} and a gap under the bfloat16 bound."""
  cfg, model, prompts, a, b = built_tie
  _, target = loading.override_model(cfg, model, dtype="bfloat16")
  ar = Decoder(target, "ar").generate(prompts, 16, GREEDY).tokens
  method, (row, index) = _swap_first(ar, (a, b))
  check = compare_lib.greedy_check(target, prompts, method, ar)
  assert not check["identical"] and not check["bug"]
  (x,) = check["mismatches"]
  assert (x["row"], x["index"]) == (row, index) and {x["method_token"], x["ar_token"]} == {a, b}
  assert x["near_tie"] and x["dtype"] == "bfloat16" and set(x["top2_ids"]) == {a, b}
  assert x["gap"] < x["bound"] and x["line"].startswith("near-tie: top-2 gap ")
  line, = compare_lib.greedy_check_lines(check, "mtp")
  assert line.startswith(f"greedy outputs of mtp and AR differ at row {row}, token {index} ")
  assert line.endswith("(bfloat16)")


def test_the_same_flip_in_float32_is_a_bug(built_tie):
  """The float32 model separates a and b by 2^-10 z_a, hundreds of times
  float32's bound: the same flip is a bug there."""
  cfg, model, prompts, a, b = built_tie
  ar = Decoder(model, "ar").generate(prompts, 16, GREEDY).tokens
  method, (row, index) = _swap_first(ar, (a, b))
  check = compare_lib.greedy_check(model, prompts, method, ar)
  (x,) = check["mismatches"]
  assert check["bug"] and not x["near_tie"] and x["dtype"] == "float32"
  assert set(x["top2_ids"]) == {a, b} and x["gap"] > 10 * x["bound"], x
  assert x["line"].endswith("(float32): a bug")


def _accept_every_draft(params, g):
  """A wrong acceptance rule (``Decoder``'s ``accept_rule``): every draft
  accepted, the bonus token the target's argmax after them (AR steps as the
  real rule)."""
  if not g:
    return verify.chain_rule(params, g)

  def every(key, target, draft_q, draft_tokens):
    b = draft_tokens.shape[0]
    return jnp.full((b,), g, jnp.int32), jnp.argmax(target[:, g], -1).astype(jnp.int32)
  return every


def test_compare_reports_a_wrong_rule_as_a_bug_in_either_dtype(built_tie):
  """End to end through ``compare_with_ar`` (--compare): a method whose
  acceptance rule is wrong differs from AR at large gaps: one line per
  differing row calls it a bug, and the report's ``greedy_check`` records
  it; the correct rule's output is identical (no line, no mismatch)."""
  cfg, model, _, _, _ = built_tie
  prompts = ["abcab", "fed", "cab cab"]
  for dtype in ("float32", "bfloat16"):
    _, target = loading.override_model(cfg, model, dtype=dtype)
    kw = dict(method="mtp", repeats=1, max_new_tokens=12, sampling=GREEDY, num_samples=1,
              seed=0)
    for rule, wrong in ((_accept_every_draft, True), (verify.chain_rule, False)):
      dec = Decoder(target, "mtp", 1, accept_rule=rule)
      encoded = [np.asarray(p) for p in encode_prompts(prompts)]
      gen = dec.generate(encoded, 12, GREEDY)
      err = io.StringIO()
      report = compare_lib.compare_with_ar(dec, gen, prompts, err=err, **kw)
      check = report["greedy_check"]
      if not wrong:
        assert check == {"identical": True, "mismatches": [], "bug": False}, dtype
        assert "greedy outputs identical" in err.getvalue()
        continue
      assert check["bug"] and check["mismatches"], dtype
      lines = [l for l in err.getvalue().splitlines() if "a bug" in l]
      assert lines and all(l.startswith("WARNING: greedy outputs of mtp and AR differ at row ")
                           for l in lines), err.getvalue()
      assert all(x["dtype"] == dtype for x in check["mismatches"])
