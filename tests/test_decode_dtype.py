"""Decoding in another dtype or attention implementation than the checkpoint
saved (``decode.cli.run.load_decoder(dtype=..., attention_impl=...)``, ``python
-m decode --dtype --attention_impl``): the parameters are cast once at load,
greedy MTP still equals greedy AR in bfloat16 (or differs only at a near-tie
of the numeric contract, ``decode.cli.compare.near_tie``), an old workdir that
saved "blockwise" runs "auto", the report records what was used, and bad
values are one line naming the flag and its allowed values."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from decode.cli import compare as compare_lib
from decode.cli.run import DecodeRequest, load_decoder, run
from decode.decoder import DecodeError, Decoder, SamplingParams
from mtp import checkpoint as ckpt_lib
from mtp import loading
from mtp import model as model_lib
from mtp.config import ATTENTION_IMPLS
from tests.conftest import random_prompts, tiny_config, with_noisy_mtp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = SamplingParams(temperature=0.0)


def _floating_dtypes(params) -> set[str]:
  return {str(x.dtype) for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)}


@pytest.fixture(scope="module")
def blockwise_workdir(tmp_path_factory):
  """A tiny float32 checkpoint that saved ``model.attention_impl="blockwise"``
  (as every checkpoint from before "auto" existed) and a reduced draft
  vocabulary (integer ids among the parameters, which no cast may touch)."""
  cfg = tiny_config(model=dict(attention_impl="blockwise"), mtp=dict(draft_vocab_size=100))
  path = str(tmp_path_factory.mktemp("blockwise_wd"))
  ckpt = ckpt_lib.Checkpointer(path)
  ckpt.save(1, nnx.state(model_lib.build_model(cfg, seed=3), nnx.Param), {}, None, cfg)
  ckpt.close()
  return path


def test_bfloat16_load_casts_every_model_once(markov_workdir, blockwise_workdir):
  """--dtype bfloat16: the config says bfloat16 (activations and
  parameters), every floating parameter of the target (MTP modules
  included) and of the draft model is bfloat16 on the device, integer
  parameters keep their dtype; without the flag the checkpoint's float32."""
  dec, trained, step = load_decoder(markov_workdir, "mtp", 2, dtype="bfloat16")
  assert (dec.target_cfg.dtype, dec.target_cfg.param_dtype) == ("bfloat16", "bfloat16")
  assert _floating_dtypes(dec.target_params) == {"bfloat16"} and trained == 2 and step == 1
  assert dec.models()[0].mtp_depth == 2
  dec32, _, _ = load_decoder(markov_workdir, "mtp", 2)
  assert dec32.target_cfg.dtype == "float32" and _floating_dtypes(dec32.target_params) == {"float32"}
  draft, _, _ = load_decoder(markov_workdir, "draft", 2, draft_workdir=markov_workdir,
                             dtype="bfloat16")
  assert _floating_dtypes(draft.draft_params) == {"bfloat16"}
  assert draft.models()[1].cfg.dtype == "bfloat16"
  vocab, _, _ = load_decoder(blockwise_workdir, "mtp", 2, dtype="bfloat16")
  ids = vocab.models()[0].draft_vocab[...]
  assert ids.dtype == jnp.int32 and len(np.unique(np.asarray(ids))) == 100
  # the cast is the only change: bfloat16 parameters are the float32 ones rounded
  w32 = dec32.models()[0].embed.embedding[...]
  w16 = dec.models()[0].embed.embedding[...]
  np.testing.assert_array_equal(np.asarray(w16), np.asarray(w32.astype(jnp.bfloat16)))


@pytest.mark.parametrize("g", [1, 2])
def test_greedy_mtp_equals_ar_in_bfloat16(trained_markov, g):
  """In bfloat16 the output law is the bfloat16 target's: greedy MTP (noisy
  modules, so rows accept different numbers of drafts and verify blocks of
  every length occur) emits AR's tokens; a row that differs must be a
  near-tie of the contract (``greedy_check``: the target's top-2 gap below
  the bfloat16 bound), never a bug, and most rows are identical."""
  cfg, model, _ = trained_markov
  cfg16, target = loading.override_model(cfg, with_noisy_mtp(model, 0.5), dtype="bfloat16")
  assert target.cfg.dtype == "bfloat16"
  prompts = random_prompts([3, 9, 17, 30, 5, 12], seed=7)
  ar = Decoder(target, "ar").generate(prompts, 32, GREEDY)
  mtp = Decoder(target, "mtp", g).generate(prompts, 32, GREEDY)
  assert np.mean(mtp.target_calls) < np.mean(ar.target_calls)    # drafts were accepted
  check = compare_lib.greedy_check(target, prompts, mtp.tokens, ar.tokens)
  assert not check["bug"], check["mismatches"]
  assert len(check["mismatches"]) <= 1, check["mismatches"]
  for x in check["mismatches"]:
    assert x["near_tie"] and x["dtype"] == "bfloat16" and x["gap"] < x["bound"]


def test_old_workdir_runs_auto(blockwise_workdir):
  """A checkpoint that saved "blockwise" decodes with --attention_impl auto
  (every attention layer built with it; on the CPU "auto" resolves to
  "blockwise", so the greedy tokens are the same bit for bit) and "dense"
  (same tokens within float32 rounding on this model); the report records
  the configured and the resolved implementation."""
  prompts = random_prompts([4, 11], seed=1)
  tokens = {}
  for impl in (None, "auto", "dense"):
    dec, _, _ = load_decoder(blockwise_workdir, "mtp", 2, attention_impl=impl)
    want = impl or "blockwise"
    assert dec.target_cfg.attention_impl == want
    assert {b.attn.attention_impl for b in dec.models()[0].blocks} == {want}
    tokens[impl] = dec.generate(prompts, 12, GREEDY).tokens
  for impl in ("auto", "dense"):
    for a, b in zip(tokens[impl], tokens[None]):
      np.testing.assert_array_equal(a, b)
  report = run(DecodeRequest(blockwise_workdir, ["ab"], method="ar", max_new_tokens=3,
                             sampling=GREEDY, attention_impl="auto", dtype="bfloat16"),
               out=open(os.devnull, "w"), err=open(os.devnull, "w")).to_json()
  c = report["config"]
  assert (c["dtype"], c["param_dtype"], c["attention_impl"]) == ("bfloat16", "bfloat16", "auto")
  assert c["attention_impl_resolved"] == model_lib.resolve_attention_impl(
      "auto", model_lib.attention_backend(), "bfloat16", 8)


def test_bad_values_are_one_line_naming_the_flag(blockwise_workdir):
  """Through mtp.config's validation: an unknown implementation names
  --attention_impl and every allowed value; "cudnn" with a float32 model
  names --dtype as the way out; a dtype outside float32/bfloat16 names
  --dtype. All before any parameter is read."""
  with pytest.raises(DecodeError) as e:
    load_decoder(blockwise_workdir, "mtp", 2, attention_impl="flash")
  msg = str(e.value)
  assert msg.startswith("--attention_impl='flash' is not allowed") and "\n" not in msg
  assert all(repr(v) in msg for v in ATTENTION_IMPLS)
  with pytest.raises(DecodeError) as e:
    load_decoder(blockwise_workdir, "mtp", 2, attention_impl="cudnn")
  msg = str(e.value)
  assert msg.startswith("--attention_impl='cudnn'") and "--dtype" in msg and "\n" not in msg
  if jax.default_backend() == "gpu":
    load_decoder(blockwise_workdir, "ar", 1, attention_impl="cudnn", dtype="bfloat16")  # allowed
  else:                       # cuDNN exists only on NVIDIA GPUs: one line, not a RuntimeError later
    with pytest.raises(DecodeError, match=r"^--attention_impl=cudnn needs an NVIDIA GPU \(cuDNN\); "
                                          rf"this backend is {jax.default_backend()}"):
      load_decoder(blockwise_workdir, "ar", 1, attention_impl="cudnn", dtype="bfloat16")
  for bad in ("float16", "fp32", "bf16"):
    with pytest.raises(DecodeError, match=rf"^--dtype='{bad}' is not allowed: must be one of "
                                          r"float32, bfloat16"):
      run(DecodeRequest(blockwise_workdir, ["ab"], method="ar", dtype=bad))


def _cli(*args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "decode", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.cpu_only
def test_cli_flags(blockwise_workdir, tmp_path):
  """python -m decode --dtype bfloat16 --attention_impl dense: the --json
  report and the statistics say so; a bad --attention_impl is exit 2 with
  one line and no traceback."""
  out = tmp_path / "r.json"
  r = _cli("--workdir", blockwise_workdir, "--prompt", "ab", "--method", "ar",
           "--max_new_tokens", "3", "--dtype", "bfloat16", "--attention_impl", "dense",
           "--json", str(out))
  assert r.returncode == 0, r.stderr[-2000:]
  c = json.loads(out.read_text())["config"]
  assert (c["dtype"], c["attention_impl"], c["attention_impl_resolved"]) == (
      "bfloat16", "dense", "dense")
  assert "dtype bfloat16, attention dense" in r.stderr
  r = _cli("--workdir", blockwise_workdir, "--prompt", "ab", "--attention_impl", "flash")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: --attention_impl='flash' is not allowed")
