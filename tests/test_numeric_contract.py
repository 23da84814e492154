"""The numeric contract in float32 (docs/speculative_sampling.md, "Numeric
contract"; ``decode.cli.compare.logit_error_bound``): every computation of the
target's logits (the cache-free forward; AR steps against KV caches of
512, 2,048 and 8,192 slots and verify blocks of G + 1 tokens, G = 1, 2, 3,
with each attention implementation a float32 model runs) agrees with every
other within the per-logit bound D, and greedy ``--method mtp`` (G = 1..3,
each implementation) emits greedy AR's tokens on the greedy tests' prompts
(tests/test_decode.py) wherever AR's top-2 gap is at least the near-tie
threshold 2 D (every token on this CPU). Device-agnostic: float32 matmuls
run at ``model.matmul_precision`` = "highest" on every backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from decode.cli import compare as compare_lib
from decode.decoder import Decoder, SamplingParams
from mtp import loading
from mtp import model as model_lib
from tests.conftest import random_prompts, tiny_config, with_noisy_mtp

GREEDY = SamplingParams(temperature=0.0)

# the float32 implementations: "cudnn" is bfloat16/float16 only, and "auto"
# resolves to one of these two in float32 on every backend
IMPLS = ("blockwise", "dense")
CACHE_SLOTS = (512, 2048, 8192)
GS = (1, 2, 3)
# verify blocks of G + 1 tokens per cache size: with AR steps at every size,
# every cache size runs both kinds of cached call and every G runs with both
# implementations (each scan costs a compilation of about 1 s on 2 CPU cores)
VERIFY_G = {512: 1, 2048: 2, 8192: 3}
# logits at positions PROMPT-1 .. TOTAL-1 (37 of them); TOTAL - PROMPT = 36
# is a multiple of every block length G + 1 = 1..4, so each path runs whole
# blocks only
PROMPT, TOTAL, BATCH = 12, 48, 2


def _float32_model():
  """(cfg, model): test_near_tie's tiny float32 model (L = 2, no MTP
  modules), its RoPE long enough for an 8,192-slot cache."""
  cfg = tiny_config(model=dict(max_seq_len=max(CACHE_SLOTS)), mtp=dict(depth=0))
  return cfg, model_lib.build_model(cfg, seed=1)


def _cached_paths(model, cfg, tokens, cache_slots: int, steps) -> dict[int, np.ndarray]:
  """{block length: logits [B, TOTAL - PROMPT + 1, V]} from a prefill of
  PROMPT tokens into a cache of ``cache_slots`` slots, then cached calls of
  ``step`` tokens for each of ``steps`` (1: AR steps; G + 1: verify blocks)
  teacher-forced along ``tokens``, each a ``lax.scan`` from the same
  prefilled cache: one compiled program per (implementation, cache size)."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, tokens):
    m = nnx.merge(graphdef, state)
    b = tokens.shape[0]
    cache = model_lib.init_layer_caches(cfg.model, cfg.model.num_layers, b, cache_slots)
    pos = jnp.broadcast_to(jnp.arange(TOTAL, dtype=jnp.int32), (b, TOTAL))
    h, cache = m.backbone(tokens[:, :PROMPT], pos[:, :PROMPT], cache=cache)
    first = m.head(h[:, -1:])
    out = {}
    for step in steps:
      n = (TOTAL - PROMPT) // step
      blocks = lambda x: x[:, PROMPT:].reshape(b, n, step).transpose(1, 0, 2)

      def call(cache, xs):
        toks, p = xs
        h, cache = m.backbone(toks, p, cache=cache)
        return cache, m.head(h)
      _, logits = jax.lax.scan(call, cache, (blocks(tokens), blocks(pos)))   # [n, B, step, V]
      logits = logits.transpose(1, 0, 2, 3).reshape(b, n * step, -1)
      out[step] = jnp.concatenate([first, logits], 1)
    return out
  return {k: np.asarray(v) for k, v in run(state, tokens).items()}


def _cache_free(model, tokens):
  """(logits [B, T, V] float32, logit scale [B, T]) of one jitted cache-free
  forward: the scale is ``target_logits_at``'s ||final_norm(h)|| max_v
  ||W_v|| (W the output head) at every position."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, tokens):
    m = nnx.merge(graphdef, state)
    out = m(tokens)
    hn = m.final_norm(out.hidden[0]).astype(jnp.float32)
    w = m.embed.embedding[...] if m.cfg.tie_embeddings else m.lm_head.kernel[...].T
    w_norm = jnp.linalg.norm(w.astype(jnp.float32), axis=-1).max()
    return out.logits, jnp.linalg.norm(hn, axis=-1) * w_norm
  logits, scale = run(state, tokens)
  return np.asarray(logits), np.asarray(scale)


@pytest.fixture(scope="module")
def logit_paths():
  """(D [B, TOTAL - PROMPT + 1], {path name: logits [B, TOTAL - PROMPT + 1,
  V]}) at positions PROMPT-1 .. TOTAL-1 of random ids: the cache-free
  forward and, per implementation, AR steps with every cache size and
  verify blocks of G + 1 tokens with the sizes of VERIFY_G. D is
  ``logit_error_bound("float32")`` per position: its logit scale (from the
  cache-free forward), L layers and n = position + 1 positions attended."""
  cfg32, model32 = _float32_model()
  assert cfg32.model.dtype == "float32" and cfg32.model.matmul_precision == "highest"
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (BATCH, TOTAL)), jnp.int32)
  free, scale = _cache_free(model32, tokens)
  paths = {"cache-free": free[:, PROMPT - 1:]}
  for impl in IMPLS:
    cfg, model = loading.override_model(cfg32, model32, attention_impl=impl)
    assert cfg.model.attention_impl == impl
    for slots in CACHE_SLOTS:
      steps = (1, VERIFY_G[slots] + 1)
      for step, logits in _cached_paths(model, cfg, tokens, slots, steps).items():
        name = f"{impl} S={slots} " + ("AR" if step == 1 else f"verify G={step - 1}")
        paths[name] = logits
  lengths = np.broadcast_to(np.arange(PROMPT, TOTAL + 1), (BATCH, TOTAL - PROMPT + 1))
  bound = np.vectorize(lambda s, n: compare_lib.logit_error_bound(
      "float32", scale=float(s), layers=cfg32.model.num_layers, length=int(n), max_logit=0.0))(
          scale[:, PROMPT - 1:], lengths)
  return bound, paths


def test_auto_resolves_to_a_tested_implementation_in_float32():
  """"auto" on this backend runs one of IMPLS for a float32 model, so the
  paths below cover it."""
  resolved = model_lib.resolve_attention_impl("auto", model_lib.attention_backend(), "float32",
                                              tiny_config().model.head_dim)
  assert resolved in IMPLS, resolved


def test_every_pair_of_paths_is_within_the_float32_bound(logit_paths):
  """Every pair of the 13 computations (cache-free; per implementation in
  {blockwise, dense}: AR steps with 512, 2,048 and 8,192 slots, verify
  blocks of G = 1, 2, 3 with 512, 2,048 and 8,192 slots respectively)
  differs at every position and id by at most the contract's per-logit D
  (not the near-tie threshold 2 D), -inf ids alike; the largest difference
  is also more than D / 64 (the paths do round differently: the bound is
  not checked against bit-identical copies only). The message gives the
  measured maximum of |z^A - z^B| / D and the pair. Measured on this CPU
  (2 cores, 2026-12-04): at most 0.16 D (3.4e-6, cache-free vs "dense");
  "blockwise" vs "dense" 0.14 D; within one implementation every cache
  size and block length agrees bit for bit except "blockwise" verify
  blocks of 4 tokens (0.12 D)."""
  bound, paths = logit_paths
  finite = np.isfinite(paths["cache-free"])
  names = list(paths)
  ratios = {}
  for i, a in enumerate(names):
    np.testing.assert_array_equal(np.isfinite(paths[a]), finite, err_msg=a)
    za = np.where(finite, paths[a], 0.0)
    for b in names[i + 1:]:
      diff = np.abs(za - np.where(finite, paths[b], 0.0)).max(-1)
      k = np.unravel_index(np.argmax(diff / bound), diff.shape)
      ratios[(a, b)] = (float(diff[k] / bound[k]), float(diff[k]), float(bound[k]))
  worst = max(ratios, key=lambda p: ratios[p][0])
  r, d, bd = ratios[worst]
  msg = (f"max |z^A - z^B| / D = {r:.3g} ({d:.3g} against D = {bd:.3g}) for {worst[0]!r} vs "
         f"{worst[1]!r}; pairs over D: "
         f"{sorted((p, round(v[0], 3)) for p, v in ratios.items() if v[0] > 1)[:8]}")
  assert r <= 1.0, msg
  assert r > 1 / 64, msg


# -- greedy MTP == greedy AR on the greedy tests' prompts -----------------------------

@pytest.fixture(scope="module")
def greedy_target(trained_markov):
  """tests/test_decode.py's target (the trained Markov model, noise on its
  MTP modules only, so rows accept different numbers of drafts), its
  prompts, AR's greedy tokens with IMPLS[0], and the contract's verdict at
  every token AR emitted: ``near_tie`` in float32 on one cache-free forward
  over prompt and output (the rows right-padded to one length: the forward
  is causal), a list per row of (emitted token, verdict)."""
  cfg, model, _ = trained_markov
  target = with_noisy_mtp(model, 0.5)
  prompts = random_prompts([3, 9, 17, 30])
  _, t = loading.override_model(cfg, target, attention_impl=IMPLS[0])
  ref = Decoder(t, "ar").generate(prompts, 24, GREEDY)
  seqs = [np.concatenate([p, out]).astype(np.int32) for p, out in zip(prompts, ref.tokens)]
  width = max(len(q) for q in seqs)
  logits, scale = _cache_free(target, jnp.asarray(
      np.stack([np.pad(q, (0, width - len(q))) for q in seqs])))
  verdicts = [[(int(q[i]), compare_lib.near_tie(
      logits[r, i - 1], dtype="float32", scale=float(scale[r, i - 1]),
      layers=target.cfg.num_layers, length=i)) for i in range(len(p), len(q))]
      for r, (p, q) in enumerate(zip(prompts, seqs))]
  return cfg, target, prompts, ref, verdicts


def _first_near_tie(row) -> int:
  """The index of the first token of a row of verdicts whose top-2 gap is
  under the near-tie threshold 2 D (the row's length when none is)."""
  return next((j for j, (_, v) in enumerate(row) if v["near_tie"]), len(row))


def test_ar_greedy_reference_is_the_argmax_away_from_near_ties(greedy_target):
  """Every row has its 24 tokens; up to a row's first near-tie (all of it
  when there is none) each token AR emitted is the cache-free forward's
  top-1 with a top-2 gap of at least 2 D, so by the contract every path must
  emit it; near-ties are rare on these prompts (at most 2 of 96 tokens;
  none on this CPU, the smallest gap 1.04 x 2 D: row 2, token 22, 7.4e-5),
  so the equality below covers nearly every token."""
  _, _, prompts, ref, verdicts = greedy_target
  ratios = [(v["gap"] / v["bound"], r, j) for r, row in enumerate(verdicts)
            for j, (_, v) in enumerate(row)]
  msg = "smallest top-2 gap / 2 D = %.3g (row %d, token %d)" % min(ratios)
  for r, row in enumerate(verdicts):
    assert len(row) == len(ref.tokens[r]) == 24, (r, len(ref.tokens[r]))
    for j, (token, v) in enumerate(row[:_first_near_tie(row)]):
      assert v["top2_ids"][0] == token, (r, j, v, msg)
  assert sum(v["near_tie"] for row in verdicts for _, v in row) <= 2, msg


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_mtp_equals_ar_across_impls_and_g(greedy_target, impl):
  """Greedy ``--method mtp`` (G = 1, 2, 3) with attention ``impl`` emits
  the tokens of greedy AR with IMPLS[0], row by row (AR itself across
  implementations: the logits test above), up to the row's first near-tie
  of AR's output (where the contract allows another token: on this CPU
  there is none, so the rows are identical); a difference is reported with
  the contract's verdict (``greedy_check``: near-tie or bug), and a bug
  fails wherever it is."""
  cfg, target, prompts, ref, verdicts = greedy_target
  _, t = loading.override_model(cfg, target, attention_impl=impl)
  assert t.cfg.attention_impl == impl and t.cfg.dtype == "float32"
  accepted = 0
  for g in GS:
    gen = Decoder(t, "mtp", g).generate(prompts, 24, GREEDY)
    check = compare_lib.greedy_check(t, prompts, gen.tokens, ref.tokens)
    lines = compare_lib.greedy_check_lines(check, f"mtp G={g}")
    assert not check["bug"], (impl, lines)
    for x in check["mismatches"]:
      first = _first_near_tie(verdicts[x["row"]])
      assert x["index"] >= first, (impl, f"row {x['row']}: AR's first near-tie at {first}", lines)
    accepted += int(gen.accepted_histogram[:, 1:].sum())
  assert accepted > 0, "the drafter should get some drafts accepted"


def test_target_logits_at_is_the_cache_free_forward_at_the_last_position():
  """``compare.target_logits_at`` (the near-tie check of ``--compare``) runs
  the prefix padded to a bucket, clamped to max_seq_len: its logits and
  logit scale equal the unpadded cache-free forward's at the prefix's last
  position (prefixes of 1, 9 (bucket 16), 70 (bucket 128 > max_seq_len 100)
  and 100 ids)."""
  cfg = tiny_config(model=dict(max_seq_len=100), mtp=dict(depth=0))
  model = model_lib.build_model(cfg, seed=2)
  rng = np.random.default_rng(5)
  for n in (1, 9, 70, 100):
    ids = rng.integers(0, 256, n).astype(np.int32)
    logits, scale = compare_lib.target_logits_at(model, ids)
    want, want_scale = _cache_free(model, jnp.asarray(ids[None]))
    np.testing.assert_allclose(logits, want[0, -1], atol=1e-5, err_msg=f"n={n}")
    assert scale == pytest.approx(float(want_scale[0, -1]), rel=1e-5), n
