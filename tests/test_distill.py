"""Second training stage: distillation of the MTP modules from the main head,
frozen backbone, init_from, recursive steps past D, teacher metrics, and
self-distilled data (issue 12). Decoding with distilled modules stays
lossless (chi-square and greedy equality on a distilled model)."""

import json
import os

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from decode import round as round_lib
from decode.decoder import Decoder, SamplingParams
from mtp import checkpoint as ckpt_lib
from mtp import loading
from mtp import tokenizer as tok
from mtp.config import ConfigError
from mtp.model import ModelOutput
from tests.conftest import ALPHABET, markov_batch, tiny_config
from train import losses
from train.loop import MTP_PARAMS, Trainer, train

PAD = tok.PAD_ID
GREEDY = SamplingParams(temperature=0.0)


# -- config -------------------------------------------------------------------------

@pytest.mark.parametrize("section,fields,match", [
    ("mtp", dict(distill_weight=-0.1), r"mtp\.distill_weight=-0\.1 is out of range: must be in \[0, 1\]"),
    ("mtp", dict(distill_weight=1.5), r"mtp\.distill_weight=1\.5 .*in \[0, 1\]"),
    ("mtp", dict(distill_temperature=0.0), r"mtp\.distill_temperature=0\.0 .*in \(0, 100\]"),
    ("mtp", dict(recursive_steps=-1), r"mtp\.recursive_steps=-1 .*\[0, 16\]"),
    ("mtp", dict(distill_divergence="js"), r"mtp\.distill_divergence='js' .*one of \('kl', 'tv'\)"),
    ("mtp", dict(recursive_steps=17), r"mtp\.recursive_steps=17 .*\[0, 16\]"),
    ("mtp", dict(depth=0, distill_weight=0.5), r"mtp\.distill_weight=0\.5 .*mtp\.depth = 0"),
    ("mtp", dict(depth=0, recursive_steps=1), r"mtp\.recursive_steps=1 .*mtp\.depth = 0"),
    ("mtp", dict(depth=16, recursive_steps=15), r"train\.seq_len=32 .*mtp\.recursive_steps \+ 1 = 32"),
])
def test_config_fields_are_validated(section, fields, match):
  with pytest.raises(ConfigError, match=match):
    tiny_config(**{section: fields})


def test_freeze_backbone_needs_modules():
  with pytest.raises(ConfigError, match=r"train\.freeze_backbone=True .*mtp\.depth = 0"):
    tiny_config(mtp=dict(depth=0), train=dict(freeze_backbone=True))
  assert tiny_config().mtp.distill_weight == 0.0 and not tiny_config().train.freeze_backbone


# -- the distillation loss -------------------------------------------------------------

def _log_softmax(x):
  x = x.astype(np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _reference(logits, mtp_logits, tokens, seg, lam, depth, w, tau, div="kl"):
  """Loop-based statement of the mixed objective (train/losses.py docstring)."""
  b_, t_ = tokens.shape
  def head(k):       # depth k >= 1: module logits at i vs main at i+k, target t_{i+k+1}
    ce = kl = kl1 = agree = n = 0.0
    for b in range(b_):
      for i in range(t_):
        j = i + k + 1
        if j >= t_ or seg[b, i] == 0 or seg[b, j] != seg[b, i] or tokens[b, j] == PAD:
          continue
        q = _log_softmax(mtp_logits[k - 1][b, i])
        ce -= q[tokens[b, j]]
        lp, lq = _log_softmax(logits[b, i + k] / tau), _log_softmax(mtp_logits[k - 1][b, i] / tau)
        kl += (np.sum(np.exp(lp) * (lp - lq)) if div == "kl"
               else 0.5 * np.sum(np.abs(np.exp(lp) - np.exp(lq))))
        p1 = _log_softmax(logits[b, i + k])
        kl1 += np.sum(np.exp(p1) * (p1 - q))
        agree += np.argmax(mtp_logits[k - 1][b, i]) == np.argmax(logits[b, i + k])
        n += 1
    n = max(n, 1)
    return (1 - w) * ce / n + w * tau ** 2 * kl / n, kl1 / n, agree / n
  main = 0.0
  n = 0
  for b in range(b_):
    for i in range(t_ - 1):
      if seg[b, i] and seg[b, i + 1] == seg[b, i] and tokens[b, i + 1] != PAD:
        main -= _log_softmax(logits[b, i])[tokens[b, i + 1]]
        n += 1
  heads = [head(k) for k in range(1, len(mtp_logits) + 1)]
  return main / n + lam / depth * sum(h[0] for h in heads), heads


@pytest.mark.parametrize("w,tau,extra,div", [(0.0, 1.0, 0, "kl"), (0.3, 1.0, 1, "kl"),
                                             (1.0, 2.0, 2, "kl"), (0.6, 1.5, 1, "tv")])
def test_distill_loss_matches_reference(w, tau, extra, div):
  """D = 2 depths plus ``extra`` recursive ones, packed documents and padding."""
  rng = np.random.default_rng(int(w * 10) + extra)
  b, t, v, depth = 3, 12, 16, 2
  tokens = rng.integers(0, v, (b, t)).astype(np.int32)
  seg = np.asarray([[1] * 5 + [2] * 5 + [3] * 2, [1] * 12, [1] * 7 + [0] * 5], np.int32)
  tokens[seg == 0] = PAD
  logits = rng.normal(size=(b, t, v)).astype(np.float32) * 2
  mtp_logits = [rng.normal(size=(b, t, v)).astype(np.float32) * 2 for _ in range(depth + extra)]
  out = ModelOutput(jnp.asarray(logits), tuple(map(jnp.asarray, mtp_logits)), ())
  loss, sums = losses.mtp_loss(out, jnp.asarray(tokens), jnp.asarray(seg), 0.4, depth=depth,
                               distill_weight=w, distill_temperature=tau, distill_divergence=div)
  want, heads = _reference(logits, mtp_logits, tokens, seg, 0.4, depth, w, tau, div)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  metrics = losses.summarize(jax.device_get(sums))
  for k, (_, kl1, agree) in enumerate(heads, 1):
    np.testing.assert_allclose(metrics[f"mtp_{k}/teacher_kl"], kl1, rtol=1e-5, atol=1e-7)
    assert metrics[f"mtp_{k}/teacher_agreement"] == pytest.approx(agree)
  assert set(sums) == {"main"} | {f"mtp_{k}" for k in range(1, depth + extra + 1)}


def test_teacher_gets_no_gradient_and_padding_vocab_stays_finite():
  """A stop-gradient on the teacher: with w = 1 the loss gradient w.r.t. the
  main logits is the main cross-entropy's alone; logits with -inf vocabulary
  padding (as the model's head emits) give finite values and gradients."""
  rng = np.random.default_rng(0)
  b, t, v = 2, 6, 12
  pad_mask = np.isin(np.arange(v), [9, 10])    # (not the last id: PAD targets are clipped to it)
  tokens = jnp.asarray(rng.integers(0, 9, (b, t)), jnp.int32)
  main = jnp.where(pad_mask, -jnp.inf, jnp.asarray(rng.normal(size=(b, t, v)), jnp.float32))
  mtp = jnp.where(pad_mask, -jnp.inf, jnp.asarray(rng.normal(size=(b, t, v)), jnp.float32))

  def f(main, mtp, w):
    return losses.mtp_loss(ModelOutput(main, (mtp,), ()), tokens, None, 1.0, distill_weight=w)[0]
  g_main_1, g_mtp_1 = jax.grad(f, argnums=(0, 1))(main, mtp, 1.0)
  g_main_0 = jax.grad(f)(main, mtp, 0.0)
  assert np.isfinite(float(f(main, mtp, 1.0)))
  assert np.all(np.isfinite(g_mtp_1)) and np.any(g_mtp_1 != 0)
  np.testing.assert_array_equal(g_main_1, g_main_0)     # the teacher term adds nothing


# -- recursive steps: training inputs are the decoder's ----------------------------------

def test_recursive_steps_equal_the_decoders_reuse_of_module_d(trained_markov):
  """G = D + 2 drafts with module D reused twice: after prefill and over
  rounds with random accepted lengths, every draft distribution q_k
  (k = 1..G) equals the model's training forward with recursive_steps = 2
  over the committed tokens followed by the drafts (teacher forcing), at
  position n-2: the training chain sees exactly the decoder's inputs."""
  model = trained_markov[1]
  d, r = model.mtp_depth, 2
  g = d + r
  dec = Decoder(model, "mtp", g)
  warp = SamplingParams(temperature=1.0)
  rng = np.random.default_rng(4)
  prompts = [np.concatenate([[tok.BOS_ID], rng.choice(ALPHABET, n)]).astype(np.int32) for n in (2, 9)]
  state, prefill_len = dec.prepare(prompts, 30, seed=0)
  state = dec.prefill(state, prefill_len)
  propose = jax.jit(lambda params, s: round_lib.propose(dec.drafter, *dec.models(params), s, warp,
                                                         dec.longest_draft))
  commit = jax.jit(functools.partial(round_lib.commit, dec.drafter))
  full = jax.jit(lambda params, x: dec.models(params)[0](x, recursive_steps=r).mtp_logits)
  for _ in range(5):
    state, (d_tok, d_probs, p, h0, _) = propose(dec.target_params, state)
    n = np.asarray(state.length)
    # one fixed-shape forward over the whole buffer (causal: later slots do not matter)
    mtp_logits = full(dec.target_params, state.tokens)
    assert len(mtp_logits) == g
    for b in range(len(prompts)):
      for k in range(1, g + 1):
        np.testing.assert_allclose(d_probs[b, k - 1], jax.nn.softmax(mtp_logits[k - 1][b, n[b] - 2]),
                                   atol=2e-5, err_msg=f"row {b} draft {k}")
    a = jnp.asarray(rng.integers(0, g + 1, len(prompts)), jnp.int32)
    state = commit(state, d_tok, a, jnp.asarray(rng.choice(ALPHABET, len(prompts)), jnp.int32), h0)


# -- a frozen-backbone distillation stage on the Markov model ------------------------------

STAGE = dict(mtp=dict(distill_weight=1.0, distill_temperature=1.0, recursive_steps=1),
             train=dict(num_steps=40, batch_size=16, seq_len=32, warmup_steps=0, learning_rate=1e-2,
                        freeze_backbone=True))


def _teacher_kl(trainer, params, batch):
  sums = trainer.eval_sums(params, [batch])
  m = losses.summarize(sums)
  return [m[f"mtp_{k}/teacher_kl"] for k in (1, 2, 3)]


@pytest.fixture(scope="module")
def distilled(trained_markov):
  """(trainer, params before, params after, KL before, KL after, step metrics):
  40 steps of teacher-only distillation with the backbone frozen and one
  recursive step, from the trained Markov model."""
  cfg0, model, transition = trained_markov
  cfg = tiny_config(**STAGE)
  trainer = Trainer(cfg)
  before = nnx.state(model, nnx.Param)
  state = trainer.init_state(before)
  rng = np.random.default_rng(1)
  held = markov_batch(np.random.default_rng(99), 16, 32, transition)
  kl_before = _teacher_kl(trainer, state.params, held)
  for _ in range(cfg.train.num_steps):
    state, metrics = trainer.train_step(state, markov_batch(rng, 16, 32, transition))
  kl_after = _teacher_kl(trainer, state.params, held)
  return trainer, before, state, kl_before, kl_after, jax.device_get(metrics)


def test_frozen_stage_changes_only_the_modules(distilled):
  trainer, before, state, kl_before, kl_after, metrics = distilled
  flat_before = dict(nnx.to_flat_state(before))
  changed = {}
  for path, var in nnx.to_flat_state(state.params):
    old, new = np.asarray(flat_before[path][...]), np.asarray(var[...])
    if path[0] == "mtp":
      changed[path] = not np.array_equal(old, new)
    else:                                                    # bitwise, not approximately
      assert old.tobytes() == new.tobytes(), f"frozen parameter {path} changed"
  assert all(changed.values()) and len(changed) > 10
  # optimizer state exists for the MTP parameters only (Adam mu and nu)
  n_mtp = len(jax.tree.leaves(nnx.split_state(before, MTP_PARAMS, ...)[0]))
  paths = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(state.opt_state)
           if getattr(x, "ndim", 0) >= 1]
  assert len(paths) == 2 * n_mtp and all("'mtp'" in p for p in paths), paths[:4]
  assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0


def test_distillation_lowers_the_kl_to_the_teacher(distilled):
  _, _, _, kl_before, kl_after, _ = distilled
  for k, (b, a) in enumerate(zip(kl_before, kl_after), 1):
    assert a < 0.8 * b, f"depth {k}: KL {b:.4f} -> {a:.4f}"


def test_ar_output_is_unchanged_and_distilled_decoding_is_lossless(distilled, trained_markov):
  """Greedy AR output identical before and after the stage; greedy MTP with
  G = D + 1 (the recursive step) equals AR; and the first two tokens sampled
  by MTP speculative decoding with the distilled modules follow the exact
  target law (chi-square, tests/test_decode_distribution.py harness)."""
  from tests.test_decode_distribution import (ALPHA, SETTINGS, _sample_pairs, chi_square_pvalue,
                                              exact_pair_law)
  trainer, _, state, *_ = distilled
  model = trainer.model(state.params)
  rng = np.random.default_rng(5)
  prompts = [np.concatenate([[tok.BOS_ID], rng.choice(ALPHABET, n)]).astype(np.int32) for n in (3, 11)]
  ar = Decoder(trained_markov[1], "ar")
  ar_before = ar.generate(prompts, 20, GREEDY)
  ar.target_params = nnx.state(model, nnx.Param)      # same compiled decoder, distilled parameters
  ar_after = ar.generate(prompts, 20, GREEDY)
  mtp = Decoder(model, "mtp", 3).generate(prompts, 20, GREEDY)
  for b in range(len(prompts)):
    np.testing.assert_array_equal(ar_after.tokens[b], ar_before.tokens[b])
    np.testing.assert_array_equal(mtp.tokens[b], ar_before.tokens[b])
  sp = SETTINGS["t1"]
  pairs, gen = _sample_pairs(Decoder(model, "mtp", 3), sp, seed=321)
  assert gen.accepted_histogram[:, 1:].sum() > 0
  pvalue = chi_square_pvalue(pairs, exact_pair_law(model, sp))
  assert pvalue > ALPHA, f"distilled MTP G=3: chi-square p={pvalue:.2e}"


@pytest.mark.cpu_only
def test_frozen_distillation_stage_on_a_2x2x2_mesh(tmp_path):
  """The sharded jit (data, FSDP and tensor axes on 8 fake devices) trains a
  frozen-backbone distillation stage with a recursive step like one device;
  the frozen parameters stay bitwise equal on both."""
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = tmp_path / "distill.json"
  r = subprocess.run([sys.executable, os.path.join(repo, "tests", "sharding_worker.py"), "distill",
                      "--workdir", str(tmp_path), "--out", str(out)], cwd=repo, env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  res = json.loads(out.read_text())
  assert res["devices"] == 8
  np.testing.assert_allclose(res["losses"]["2x2x2"], res["losses"]["1x1x1"], rtol=1e-5)
  assert res["frozen_bitwise"] == {"2x2x2": True, "1x1x1": True}
  assert res["moved"] > 1e-4 and res["trained_max_diff"] < 1e-4


# -- the stage from a workdir: init_from, resume, errors ---------------------------------

def _stage_cfg(data_dir, src, **train):
  return tiny_config(data=dict(data_dir=data_dir),
                     mtp=dict(distill_weight=0.5, distill_temperature=2.0, recursive_steps=1),
                     train={"init_from": src, "freeze_backbone": True, **train})


def _rows(workdir, split):
  out = {}
  for line in open(os.path.join(workdir, "metrics.jsonl")):
    r = json.loads(line)
    if r["split"] == split:
      out[r["step"]] = r
  return out


def test_stage_from_a_workdir_resumes_exactly(markov_workdir, data_dir, tmp_path):
  from mtp.cli import compile_cache
  with compile_cache(str(tmp_path / "jax_cache")):      # the three runs compile the same programs
    _stage_resumes_exactly(markov_workdir, data_dir, tmp_path)


def _stage_resumes_exactly(src, data_dir, tmp_path):
  full, part = str(tmp_path / "full"), str(tmp_path / "part")
  logs = []
  result = train(_stage_cfg(data_dir, src), full, log=logs.append)
  assert any(f"initialised parameters from {src}" in line for line in logs)
  assert any("agree3=" in line and "kl3=" in line for line in logs)
  for k in (1, 2, 3):
    assert {f"mtp_{k}/teacher_kl", f"mtp_{k}/teacher_agreement"} <= set(result.eval)
  _, src_model, _ = loading.load_model(src)
  _, new_model, step = loading.load_model(full)
  assert step == 6
  src_flat = dict(nnx.to_flat_state(nnx.state(src_model, nnx.Param)))
  moved = 0
  for path, var in nnx.to_flat_state(nnx.state(new_model, nnx.Param)):
    same = np.asarray(src_flat[path][...]).tobytes() == np.asarray(var[...]).tobytes()
    assert same or path[0] == "mtp", path
    moved += not same
  assert moved > 0
  # killed after step 3 and resumed: same losses as the uninterrupted stage
  first = train(_stage_cfg(data_dir, src), part, stop_after=3)
  assert first.step == 3
  second = train(_stage_cfg(data_dir, src), part)
  want, got = _rows(full, "train"), _rows(part, "train")
  np.testing.assert_allclose([got[s]["loss"] for s in sorted(want)],
                             [want[s]["loss"] for s in sorted(want)], rtol=1e-6)
  np.testing.assert_allclose(second.eval["mtp_3/teacher_kl"], result.eval["mtp_3/teacher_kl"],
                             rtol=1e-6)
  # resuming with the backbone no longer frozen is refused (other optimizer state)
  with pytest.raises(ConfigError, match=r"train\.freeze_backbone: True != False"):
    train(_stage_cfg(data_dir, src, freeze_backbone=False, num_steps=9), part)


def test_init_from_errors(markov_workdir, data_dir, tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(ckpt_lib.CheckpointError, match="no checkpoint"):
    train(_stage_cfg(data_dir, str(empty)), str(tmp_path / "a"))
  bad = _stage_cfg(data_dir, markov_workdir).replace(model=dict(d_model=48))
  with pytest.raises(ckpt_lib.CheckpointError, match=r"init_from=.*model\.d_model: 32 != 48"):
    train(bad, str(tmp_path / "b"))
  with pytest.raises(ConfigError, match="own --workdir"):
    train(_stage_cfg(data_dir, markov_workdir), markov_workdir)
  assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# -- self-distilled data and the evidence script -----------------------------------------------

def test_written_dataset_reads_like_any_other(tmp_path):
  from mtp import data as data_lib
  from mtp.config import DataConfig
  out = str(tmp_path / "tfds")
  train_docs = [("a", "def f():\n  return 1\n"), ("b", "x = 'é'\n")]
  data_lib.write_dataset("sd_unit", out, {"train": train_docs, "validation": [("c", "y = 2\n")]},
                             {"recipe": {"seed": 1}})
  cfg = DataConfig(name="sd_unit", data_dir=out)
  assert sorted(data_lib.load_documents(cfg, "train")) == sorted(t for _, t in train_docs)
  assert data_lib.load_documents(cfg, "validation") == ["y = 2\n"]
  batch = next(iter(data_lib.make_train_dataset(cfg, seq_len=16, batch_size=2, seed=0)))
  assert batch["tokens"].shape == (2, 16)
  meta = json.load(open(os.path.join(out, "sd_unit", "1.0.0", "metadata.json")))
  assert meta["recipe"] == {"seed": 1}
  with pytest.raises(data_lib.DataError, match="already exists"):
    data_lib.write_dataset("sd_unit", out, {"train": train_docs}, {})
  for bad in ("Bad-Name", "python_stdlib"):
    with pytest.raises(data_lib.DataError, match="snake_case"):
      data_lib.write_dataset(bad, out, {"train": train_docs}, {})


@pytest.mark.slow
def test_distill_script_quick(markov_workdir, data_dir, tmp_path):
  """experiments/distill_mtp.py --quick end to end from the Markov workdir: a
  self-distilled dataset (every document = a training-text prompt + sampled
  text), a data-only and a distilled stage with a recursive step, acceptance
  before and after, the report files; the dataset is reused for the same
  recipe only."""
  from scripts import self_distill
  from mtp import data as data_lib
  from mtp.config import DataConfig
  from tests.test_scripts import _experiment
  script = _experiment("distill_mtp")
  runs, out = str(tmp_path / "runs"), str(tmp_path / "out")
  argv = ["--quick", "--workdir", markov_workdir, "--data_dir", data_dir, "--runs_dir", runs,
          "--out", out]
  assert script.main(argv) == 0
  report = json.load(open(out + ".json"))
  meta, res = report["meta"], report["results"]
  assert {"commit", "date", "cpu_model", "command", "base_config", "budget"} <= set(meta)
  assert open(out + ".md").read().startswith("Command: `python -m experiments.distill_mtp --quick")
  sd = res["self_distilled"]
  cfg = DataConfig(name=sd["path"].split(os.sep)[-2], data_dir=sd["data_dir"])
  docs = data_lib.load_documents(cfg, "train")
  prompts = data_lib.training_prompts(DataConfig(data_dir=data_dir), 4, 32, seed=0)
  assert len(docs) == sd["num_docs"] == 4 and 0 < sd["tokens_generated"] <= 4 * 8
  for _, p in prompts:
    assert any(d.startswith(p) and len(d) > len(p) for d in docs), p
  assert sorted(data_lib.load_documents(cfg, "validation")) == sorted(
      data_lib.load_documents(DataConfig(data_dir=data_dir), "validation"))
  stages = {s["name"]: s for s in res["stages"]}
  assert set(stages) == {"kl_sd_rec_s0"}
  assert stages["kl_sd_rec_s0"]["eval"]["mtp_3/teacher_agreement"] >= 0
  for s in stages.values():
    assert s["step"] == 4 and s["tokens"] == 4 * 4 * 32 and s["train_wall_s"] > 0
    assert {(r["num_draft_tokens"], r["temperature"]) for r in s["acceptance"]} == \
        {(2, 0.0), (2, 1.0), (3, 0.0), (3, 1.0)}
  rows = {(r["model"], r["num_draft_tokens"], r["temperature"]): r for r in res["acceptance_table"]}
  r, b = rows[("kl_sd_rec", 2, 1.0)], rows[("base", 2, 1.0)]
  assert r["tau_vs_base"]["mean"] == pytest.approx(r["tau"]["mean"] / b["tau"]["mean"])
  assert set(res["targets"]) == {"kl_sd_rec"}
  assert [x["method"] for x in res["base_speed"]] == ["ar", "mtp", "ar", "mtp"]
  # the base model, hence AR output, is untouched: its parameters equal the stage's backbone
  _, base, _ = loading.load_model(markov_workdir)
  _, stage, _ = loading.load_model(stages["kl_sd_rec_s0"]["workdir"])
  np.testing.assert_array_equal(np.asarray(base.embed.embedding[...]), np.asarray(stage.embed.embedding[...]))
  # the dataset is reused for the same recipe and base, refused for another
  recipe = self_distill.Recipe(**sd["recipe"])
  name, sd_dir = sd["path"].split(os.sep)[-2], sd["data_dir"]
  again = script.self_distilled_data(markov_workdir, name, data_dir, sd_dir, recipe, log=None)
  assert again["reused"] and again["tokens_generated"] == sd["tokens_generated"]
  with pytest.raises(ConfigError, match="recipe"):
    script.self_distilled_data(markov_workdir, name, data_dir, sd_dir,
                               self_distill.Recipe(**{**sd["recipe"], "seed": 5}), log=None)


def test_distill_script_tables():
  """Per-seed ratios to the base and to the data control of the same seed,
  spreads over seeds, and the target verdicts, on hand-made rows."""
  from tests.test_scripts import _experiment
  script = _experiment("distill_mtp")
  row = lambda g, t, tau, a1: {"num_draft_tokens": g, "temperature": t, "tau": tau,
                               "alpha": [a1] + [0.5] * (g - 1)}
  base = [row(2, 0.0, 2.0, 0.80), row(2, 1.0, 2.0, 0.70)]
  stages = [{"variant": "data", "seed": 0, "acceptance": [row(2, 0.0, 1.8, 0.7), row(2, 1.0, 1.6, 0.6)]},
            {"variant": "data", "seed": 1, "acceptance": [row(2, 0.0, 1.9, 0.7), row(2, 1.0, 2.0, 0.6)]},
            {"variant": "kl", "seed": 0, "acceptance": [row(2, 0.0, 2.6, 0.95), row(2, 1.0, 2.4, 0.90)],
             "speed": [{"method": "mtp", "num_draft_tokens": 2, "temperature": 1.0, "speedup": 1.5}]},
            {"variant": "kl", "seed": 1, "acceptance": [row(2, 0.0, 2.4, 0.87), row(2, 1.0, 2.6, 0.87)]}]
  table = {(r["model"], r["num_draft_tokens"], r["temperature"]): r
           for r in script.acceptance_table(base, stages)}
  kl = table[("kl", 2, 1.0)]
  assert kl["seeds"] == [0, 1] and kl["tau"]["mean"] == pytest.approx(2.5)
  assert kl["tau_vs_base"]["mean"] == pytest.approx(1.25)
  assert kl["tau_vs_data"]["mean"] == pytest.approx((2.4 / 1.6 + 2.6 / 2.0) / 2)
  assert kl["alpha"][0] == {"mean": pytest.approx(0.885), "min": 0.87, "max": 0.90, "n": 2}
  assert kl["speedup"]["n"] == 1 and table[("base", 2, 1.0)]["tau_vs_data"]["n"] == 0
  verdict = script.targets(list(table.values()), depth=2)
  assert set(verdict) == {"kl"}
  v = verdict["kl"]
  assert v["alpha1_t0"] == pytest.approx(0.91) and v["alpha1_t0_met"]
  assert v["alpha1_t1"] == pytest.approx(0.885) and v["alpha1_t1_met"]
  assert not v["tau_ratio_vs_base_t1_met"] and v["tau_ratio_vs_data_t1_met"]


def test_self_distill_cli_rejects_bad_flags(markov_workdir, tmp_path, capsys, monkeypatch):
  from scripts import self_distill
  base = ["--workdir", markov_workdir, "--out_name", "sd_cli", "--out_dir", str(tmp_path)]
  for flag, value, match in (("--num_docs", "0", "--num_docs=0 must be an integer >= 1"),
                             ("--top_p", "1.5", "--top_p=1.5 must be in (0, 1]")):
    assert self_distill.main(base + [flag, value]) == 2
    assert match in capsys.readouterr().err
  assert self_distill.main(["--workdir", str(tmp_path / "none"), "--out_name", "sd_cli"]) == 2
  assert "no checkpoint" in capsys.readouterr().err
  assert not (tmp_path / "sd_cli").exists()
  # a bad --out_name is refused before any sampling
  def no_sampling(*a, **k):
    raise AssertionError("sampled before checking --out_name")
  monkeypatch.setattr(self_distill, "generate_documents", no_sampling)
  for bad in ("BadName", "python_stdlib"):
    assert self_distill.main(["--workdir", markov_workdir, "--out_name", bad, "--out_dir",
                              str(tmp_path)]) == 2
    assert "snake_case" in capsys.readouterr().err
