"""Token trees in the decoder (decode/tree.py, ``Decoder(..., tree=...)``):
cache exactness of the tree drafter and the tree verification, greedy
equality with AR, EOS and the budget inside an accepted path, rows taking
different paths, the end-to-end law of the first two tokens (chi-square,
the harness of tests/test_decode_distribution.py: fixed seeds, significance
1e-3) with a power check, non-finite logits, bad input.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from decode import sampling
from decode import tree as tree_lib
from decode.decoder import DecodeError, Decoder, NonFiniteLogitsError, SamplingParams
from mtp import model as model_lib
from mtp import tokenizer as tok
from tests.conftest import ALPHABET, random_prompts, tiny_config, with_noisy_mtp
from tests.test_decode_distribution import (ALPHA, PROMPT, SETTINGS, chi_square_pvalue,
                                            exact_pair_law)

GREEDY = SamplingParams(temperature=0.0)
TREE = (2, 2)


_prompts = random_prompts


@pytest.fixture(scope="module")
def target(trained_markov):
  """The trained Markov model with noise on its MTP modules only (as in
  tests/test_decode.py, but more: a tree catches most of that model's
  misses): drafts are often wrong, so rows take different paths and every
  path length occurs."""
  return with_noisy_mtp(trained_markov[1], 2.0)


@pytest.fixture(scope="module")
def tree_decoder(target):
  return Decoder(target, "mtp", tree=TREE)


@pytest.fixture(scope="module")
def ar_greedy(target):
  prompts = _prompts([1, 3, 9, 17, 30])
  return prompts, Decoder(target, "ar").generate(prompts, 24, GREEDY)


def _branch(spec, node):
  """Node indices from depth 1 down to ``node`` (inclusive)."""
  out = [node]
  while spec.parents[out[-1]] >= 0:
    out.append(int(spec.parents[out[-1]]))
  return out[::-1]


@pytest.fixture(scope="module")
def depth3_model():
  """A randomly initialised D = 3 model: exactness needs no training, and
  module 3 is the first to read its nodes' hidden states from module 2's
  node entries (depth >= 2)."""
  return model_lib.build_model(tiny_config(mtp=dict(depth=3)), seed=3)


@pytest.mark.parametrize("which", ["trained_d2", "random_d3"])
def test_tree_draft_and_verify_equal_cache_free_forward(target, tree_decoder, depth3_model, which):
  """Over rounds with random accepted paths (forced, different per row),
  after prefill from prompts as short as one byte: q at every internal node
  equals module d+1 of a cache-free forward over the committed tokens and
  the branch to that node (at position n-2), and the target's p at every
  node equals the cache-free target over committed tokens + branch. Trees
  (2, 2) on the trained D = 2 model and (2, 1, 2) on a random D = 3 one."""
  dec = tree_decoder if which == "trained_d2" else Decoder(depth3_model, "mtp", tree=(2, 1, 2))
  spec = dec.tree
  warp = SamplingParams(temperature=1.0)
  prompts = _prompts([1, 6, 11], seed=4)
  state, prefill_len = dec.prepare(prompts, 40, seed=0)
  state = dec.prefill(state, prefill_len)
  propose = jax.jit(lambda params, s: tree_lib.tree_propose(dec.drafter, dec.models(params)[0], s,
                                                             warp))
  commit = jax.jit(lambda s, nt, path, a, nxt, h0: tree_lib.tree_commit(
      dec.drafter, s, nt, path, a, nxt, h0))
  full = jax.jit(lambda params, x: (lambda o: (o.logits, o.mtp_logits))(
      dec.models(params)[0](x)))
  rng = np.random.default_rng(1)
  seen_paths = set()
  for _ in range(5):
    n = np.asarray(state.length)
    state, (node_tok, q, p, h0, _) = propose(dec.target_params, state)
    tokens, node_tok = np.asarray(state.tokens), np.asarray(node_tok)
    # every (row, node) as one sequence, padded at the end (causal: padding
    # changes nothing at the positions read), in one batched forward
    seqs, where = np.full((len(prompts) * (spec.num_nodes + 1), 64), tok.PAD_ID, np.int32), []
    for b in range(len(prompts)):
      for j in range(spec.num_nodes + 1):                    # block index j (0 = root)
        branch = [] if j == 0 else [int(node_tok[b, i]) for i in _branch(spec, j - 1)]
        seq = np.r_[tokens[b, :n[b]], np.asarray(branch, np.int32)]
        seqs[len(where), :len(seq)] = seq
        where.append((b, j, len(branch)))
    logits, mtp_logits = full(dec.target_params, jnp.asarray(seqs))
    for i, (b, j, d) in enumerate(where):
      np.testing.assert_allclose(p[b, j], jax.nn.softmax(logits[i, n[b] - 1 + d]), atol=2e-5,
                                 err_msg=f"target row {b} block {j}")
      if d < spec.depth:
        np.testing.assert_allclose(q[b, j], jax.nn.softmax(mtp_logits[d][i, n[b] - 2]), atol=2e-5,
                                   err_msg=f"draft row {b} node {j} depth {d + 1}")
    # force a random path per row: a ~ U{0..m}, a random child at each depth
    a = rng.integers(0, spec.depth + 1, len(prompts))
    cur, path = np.zeros(len(prompts), int), []
    for d, bd in enumerate(spec.branching):
      cur = cur * bd + rng.integers(0, bd, len(prompts))
      path.append(spec.offsets[d + 1] + cur)
    path = np.stack(path, 1)
    seen_paths |= {tuple(path[i, :a[i]]) for i in range(len(prompts))}
    nxt = rng.choice(ALPHABET, len(prompts))
    state = commit(state, jnp.asarray(node_tok), jnp.asarray(path, jnp.int32),
                   jnp.asarray(a, jnp.int32), jnp.asarray(nxt, jnp.int32), h0)
    new = np.asarray(state.tokens)
    for b in range(len(prompts)):
      want = [node_tok[b, i] for i in path[b, :a[b]]] + [nxt[b]]
      np.testing.assert_array_equal(new[b, n[b]:n[b] + a[b] + 1], want)
  assert len(seen_paths) > 5          # rows really took different paths


def test_tree_greedy_equals_ar(target, tree_decoder, ar_greedy):
  """Both forms, a batch of prompts of different lengths (one byte up);
  rows accept different path lengths in the same rounds; a tree of depth
  1 too."""
  prompts, ref = ar_greedy
  for dec in (tree_decoder, Decoder(target, "mtp", tree=(3,))):
    forms = (dec.generate, dec.stream) if dec is tree_decoder else (dec.generate,)
    for form in forms:
      gen = form(prompts, 24, GREEDY)
      for b in range(len(prompts)):
        np.testing.assert_array_equal(gen.tokens[b], ref.tokens[b], err_msg=f"{dec.tree} row {b}")
    hist = gen.accepted_histogram
    assert hist.shape == (len(prompts), dec.tree.depth + 1)
    assert hist[:, 1:].sum() > 0 and len({tuple(h) for h in hist}) > 1
    assert gen.tree == dec.tree.branching


def test_budget_inside_an_accepted_path(tree_decoder, ar_greedy):
  """Small budgets end the generation inside an accepted path: exactly
  max_new_tokens tokens, equal to AR's first ones."""
  prompts, ref = ar_greedy
  for budget in (1, 2, 5):
    gen = tree_decoder.generate(prompts, budget, GREEDY)
    for b in range(len(prompts)):
      np.testing.assert_array_equal(gen.tokens[b], ref.tokens[b][:budget])


def test_eos_inside_an_accepted_path(tree_decoder):
  """An EOS at depth 1 of the accepted path ends the row after it: nothing
  of the deeper path nor the next token is emitted; a row without EOS
  emits the whole path and the next token."""
  dec = tree_decoder
  spec = dec.tree
  state, prefill_len = dec.prepare(_prompts([4, 4]), 20, seed=0)
  state = dec.prefill(state, prefill_len)
  n = np.asarray(state.length)
  node_tok = np.tile(np.asarray(ALPHABET[:1], np.int32), (2, spec.num_nodes))
  child = spec.offsets[2] + spec.branching[1] + 1             # node 1's 2nd child
  node_tok[:, 1] = [tok.EOS_ID, ALPHABET[2]]                  # node 1 (depth 1)
  node_tok[:, child] = ALPHABET[3]
  path = jnp.asarray([[1, child], [1, child]], jnp.int32)
  h0 = jnp.zeros((2, spec.num_nodes + 1, dec.target_cfg.d_model))
  out = jax.jit(lambda s: tree_lib.tree_commit(
      dec.drafter, s, jnp.asarray(node_tok), path, jnp.asarray([2, 2], jnp.int32),
      jnp.asarray([ALPHABET[4]] * 2, jnp.int32), h0))(state)
  length, done, toks = (np.asarray(x) for x in (out.length, out.done, out.tokens))
  np.testing.assert_array_equal(length, n + [1, 3])
  np.testing.assert_array_equal(done, [True, False])
  assert toks[0, n[0]] == tok.EOS_ID
  np.testing.assert_array_equal(toks[1, n[1]:n[1] + 3], [ALPHABET[2], ALPHABET[3], ALPHABET[4]])
  np.testing.assert_array_equal(np.asarray(out.accepted_histogram)[:, 2], [1, 1])


class _TopKChildrenSoftQ(tree_lib.TreeMTPDrafter):
  """Known bug: children taken as the top-b of q at T > 0 while the rule
  assumes they were drawn from q without replacement."""

  def draft(self, target, state, tokens, n, key, params, g=None):
    greedy = SamplingParams(params.temperature, params.top_k, params.top_p, (True, params.filtering))
    state, tokens, node_tok, logits = super().draft(target, state, tokens, n, key, greedy)
    return state, tokens, node_tok, sampling.warped_probs(logits, params)


def test_first_two_tokens_follow_the_target_law(trained_markov):
  """End to end at T = 1, T = 0.7 with top-k 3 and top-p 0.8: the first two
  tokens of 4000 tree-decoded samples follow the target's exact law; the
  top-k-children bug fails the same test (power)."""
  model = trained_markov[1]
  dec = Decoder(model, "mtp", tree=(2, 2))
  accepted = 0
  for i, (name, sp) in enumerate(SETTINGS.items()):
    law = exact_pair_law(model, sp)
    gen = dec.generate([PROMPT] * 4000, 2, sp, seed=100 + i)
    pairs = np.stack([t[:2] for t in gen.tokens])
    pvalue = chi_square_pvalue(pairs, law)
    assert pvalue > ALPHA, f"tree {name}: chi-square p={pvalue:.2e}"
    accepted += gen.accepted_histogram[:, 1:].sum()
  assert accepted > 0
  dec = Decoder(model, "mtp", tree=(2, 2),
                drafter=_TopKChildrenSoftQ(tree_lib.TreeSpec((2, 2)), model.mtp_depth))
  sp = SETTINGS["t1"]
  gen = dec.generate([PROMPT] * 4000, 2, sp, seed=100)
  assert chi_square_pvalue(np.stack([t[:2] for t in gen.tokens]), exact_pair_law(model, sp)) < ALPHA


def test_non_finite_target_logits_name_the_position(target):
  graphdef, params = nnx.split(target, nnx.Param)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  out, done = [], False
  for path, x in leaves:
    if not done and "blocks" in jax.tree_util.keystr(path):
      x, done = jnp.asarray(x).at[(0,) * x.ndim].set(jnp.nan), True
    out.append(x)
  bad = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, out))
  with pytest.raises(NonFiniteLogitsError, match=r"target produced non-finite.*row 0 at position 5"):
    Decoder(bad, "mtp", tree=(2, 1)).generate(_prompts([5, 9]), 20, GREEDY)


def test_bad_tree_input(target):
  for tree, match in [("0,2", r"--tree='0,2': every branching factor must be an integer in \[1, 64\]"),
                      ((3, 2, 1), r"--tree='3,2,1' has depth 3, but the checkpoint has D = 2 .* \[1, 2\]"),
                      ("3,x", r"--tree='3,x': give the branching per depth as comma-separated"),
                      ("", "--tree"), ("65", r"\[1, 64\]")]:
    with pytest.raises(DecodeError, match=match):
      Decoder(target, "mtp", tree=tree)
  for method in ("ar", "draft"):
    with pytest.raises(DecodeError, match=f"--tree needs --method=mtp.*--method={method}"):
      Decoder(target, method, tree=(2,), draft=target)
  d0 = model_lib.build_model(tiny_config(mtp=dict(depth=0)), seed=0)
  with pytest.raises(DecodeError, match="mtp.depth"):
    Decoder(d0, "mtp", tree=(2,))


@pytest.mark.cpu_only
def test_run_and_cli_with_a_tree(markov_workdir, capsys):
  from decode.cli.run import DecodeRequest, run
  report = run(DecodeRequest(markov_workdir, ["abca"], method="mtp", tree="2,2", max_new_tokens=8,
                             sampling=GREEDY)).to_json()
  s = report["stats"]
  assert report["config"]["tree"] == [2, 2] and report["config"]["num_draft_tokens"] == 2
  assert s["tree"] == [2, 2] and s["nodes_per_round"] == 6
  assert len(s["accepted_length_histogram"]) == 3 and len(s["acceptance_rate_per_position"]) == 2
  err = capsys.readouterr().err
  assert "tree 2,2: 6 nodes per round" in err and "acceptance per depth" in err
  assert "accepted path-length histogram (a = 0..m)" in err
  with pytest.raises(DecodeError, match="--tree needs --method=mtp"):
    run(DecodeRequest(markov_workdir, ["abca"], method="ar", tree="2"))
  import os
  import subprocess
  import sys
  r = subprocess.run([sys.executable, "-m", "decode", "--workdir", markov_workdir, "--prompt", "ab",
                      "--tree", "2,2", "--num_draft_tokens", "2"],
                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 2
  assert r.stderr.strip().splitlines()[-1] == (
      "error: --tree and --num_draft_tokens exclude each other: a tree's depth (its number of "
      "levels) takes the place of the draft length")
