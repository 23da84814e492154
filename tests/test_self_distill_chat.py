"""scripts.self_distill chat mode (issue 22) on a tiny random BPE model
imported from a GGUF file: the dataset holds token ids whose prompt part is
the chat template's rendering of each training prompt and whose loss_mask
is 0 there and 1 on the answer; the answers are the decoder's own greedy
outputs; a re-run with the same arguments does nothing; the pipeline reads
the dataset with loss_mask."""

import json
import os

import numpy as np
import pytest

from decode.decoder import DecodeError, Decoder, SamplingParams
from mtp import data, loading
from mtp import tokenizer as tok
from mtp.config import DataConfig
from scripts import self_distill as sd
from tests import tiny_bpe

@pytest.fixture(scope="module")
def bpe_workdir(tmp_path_factory):
  return tiny_bpe.import_tiny_workdir(str(tmp_path_factory.mktemp("bpe_wd")))


RECIPE = sd.ChatRecipe(chat_prompts=5, val_prompts=3, temperatures=(0.0, 1.0), max_new_tokens=6,
                       batch_size=2, max_context_chars=200, seed=0)


@pytest.fixture(scope="module")
def made(bpe_workdir, data_dir, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("sd_out"))
  meta = sd.make_chat_dataset(bpe_workdir, "chat_sd", RECIPE, data_dir=data_dir, out_dir=out,
                              log=None)
  return meta, out


def test_chat_dataset_tokens_and_loss_mask(made, bpe_workdir, data_dir):
  meta, out = made
  assert not meta["skipped"] and meta["recipe"]["temperatures"] == [0.0, 1.0]
  assert meta["splits"]["train"]["prompts"] == 5 and meta["splits"]["validation"]["prompts"] == 3
  on_disk = json.load(open(os.path.join(meta["path"], "metadata.json")))
  assert on_disk["workdir"] == os.path.abspath(bpe_workdir) and on_disk["wall_s"] > 0
  tk = tok.load_tokenizer(bpe_workdir)
  prompts = data.chat_prompts(5, seed=0, data_dir=data_dir, max_context_chars=200)
  src = data.load_source(DataConfig(name="chat_sd", data_dir=out), "train")
  assert len(src) == 5
  _, model, _ = loading.load_model(bpe_workdir)
  ar = Decoder(model, "ar", tokenizer=tk)
  seen, greedy = set(), {}
  for r in range(len(src)):
    rec = src[r]
    name = bytes(rec["name"]).decode()
    i, cat, temp = name.split(":")
    i = int(i)
    seen.add(i)
    assert cat == prompts[i]["category"] == bytes(rec["category"]).decode()
    assert temp == ("T0" if i % 2 == 0 else "T1")
    p = tk.apply_chat_template(prompts[i]["messages"], add_generation_prompt=True)
    toks, mask = rec["tokens"], rec["loss_mask"]
    assert toks.dtype == np.int32 and mask.dtype == np.int32 and toks.shape == mask.shape
    np.testing.assert_array_equal(toks[:len(p)], p)
    np.testing.assert_array_equal(mask, np.r_[np.zeros(len(p)), np.ones(len(toks) - len(p))])
    answer = toks[len(p):]
    assert 1 <= len(answer) <= RECIPE.max_new_tokens
    if len(answer) < RECIPE.max_new_tokens:          # ended early: on a stop id, kept
      assert int(answer[-1]) in tk.stop_ids
    if i % 2 == 0:
      greedy[i] = (p, answer)
  assert seen == set(range(5))
  # greedy rows are the decoder's own answers (here decoded together in one batch)
  want = ar.generate([p for p, _ in greedy.values()], RECIPE.max_new_tokens,
                     SamplingParams(temperature=0.0)).tokens
  for (_, answer), w in zip(greedy.values(), want):
    np.testing.assert_array_equal(answer, w)
  rows = data.epoch_rows(DataConfig(name="chat_sd", data_dir=out), seq_len=64, tokenizer=tk)
  assert rows["loss_mask"].sum() == meta["splits"]["train"]["answer_tokens"]


def test_rerun_is_idempotent_and_other_recipe_refused(made, bpe_workdir, data_dir):
  meta, out = made
  again = sd.make_chat_dataset(bpe_workdir, "chat_sd", RECIPE, data_dir=data_dir, out_dir=out,
                               log=None)
  assert again["skipped"] and again["splits"] == json.loads(json.dumps(meta["splits"]))
  other = sd.ChatRecipe(**{**RECIPE.__dict__, "seed": 1})
  with pytest.raises(data.DataError, match="already exists"):
    sd.make_chat_dataset(bpe_workdir, "chat_sd", other, data_dir=data_dir, out_dir=out, log=None)


@pytest.mark.parametrize("kw, needle", [
    (dict(chat_prompts=0), "--chat_prompts=0 must be an integer >= 1"),
    (dict(val_prompts=-1), "--val_prompts=-1"),
    (dict(temperatures=()), "--temperatures must list"),
    (dict(temperatures=(-1.0,)), "temperature"),
    (dict(method="draft"), "--method='draft'"),
    (dict(categories=("poems",)), "--categories='poems'"),
    (dict(max_context_chars=50), "--max_context_chars=50"),
    (dict(self_prompt_share=1.5, self_prompts="f.jsonl"), r"--self_prompt_share=1.5 must be .* \[0, 1\]"),
    (dict(self_prompt_share=0.5), "needs --self_prompts FILE"),
])
def test_chat_recipe_validation(kw, needle):
  with pytest.raises(DecodeError, match=needle):
    sd.ChatRecipe(**kw).validate()


def test_parse_temperatures():
  assert sd.parse_temperatures("0, 1") == (0.0, 1.0)
  with pytest.raises(DecodeError, match="'x' is not a number"):
    sd.parse_temperatures("0,x")
  with pytest.raises(DecodeError, match="must be >= 0"):
    sd.parse_temperatures("-2")


def test_chat_mode_needs_a_chat_template(bpe_workdir, tmp_path, data_dir, monkeypatch):
  """A tokenizer without a template (the byte tokenizer) is refused before any sampling."""
  monkeypatch.setattr(sd.tok, "load_tokenizer", lambda wd: tok.ByteTokenizer())
  with pytest.raises(DecodeError, match="needs a tokenizer with a chat template"):
    sd.make_chat_dataset(bpe_workdir, "x_sd", RECIPE, data_dir=data_dir, out_dir=str(tmp_path),
                         log=None)


def test_cli_chat_mode_bad_flag(bpe_workdir, tmp_path, capsys):
  assert sd.main(["--workdir", bpe_workdir, "--out_name", "cli_sd", "--chat_prompts", "2",
                  "--temperatures", "0,hot", "--out_dir", str(tmp_path)]) == 2
  assert "'hot' is not a number" in capsys.readouterr().err


def _records(out, name="chat_sd", split="train"):
  src = data.load_source(DataConfig(name=name, data_dir=out), split)
  return {bytes(src[i]["name"]).decode(): src[i]["tokens"] for i in range(len(src))}


def _assert_same_records(out, ref_out):
  for split in ("train", "validation"):
    got, want = _records(out, split=split), _records(ref_out, split=split)
    assert got.keys() == want.keys()
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])


def _stop_after_first_batch(bpe_workdir, data_dir, out, monkeypatch, **kw):
  """Runs the RECIPE build into ``out`` until its second batch raises; the
  decoder's ``generate`` is real again afterwards."""
  real = sd.Decoder.generate
  calls = []

  def failing(self, *a, **k):
    calls.append(1)
    if len(calls) == 2:
      raise RuntimeError("interrupted")
    return real(self, *a, **k)
  monkeypatch.setattr(sd.Decoder, "generate", failing)
  with pytest.raises(RuntimeError, match="interrupted"):
    sd.make_chat_dataset(bpe_workdir, "chat_sd", RECIPE, data_dir=data_dir, out_dir=out, log=None,
                         **kw)
  monkeypatch.setattr(sd.Decoder, "generate", real)


def test_interrupted_run_resumes_with_the_same_results(made, bpe_workdir, data_dir, tmp_path,
                                                       monkeypatch):
  _, ref_out = made
  out = str(tmp_path)
  _stop_after_first_batch(bpe_workdir, data_dir, out, monkeypatch)
  partial = os.path.join(out, ".chat_sd.partial")
  assert len([f for f in os.listdir(partial) if f.endswith(".npz")]) == 1
  with pytest.raises(data.DataError, match="partial output of another run"):
    sd.make_chat_dataset(bpe_workdir, "chat_sd", sd.ChatRecipe(**{**RECIPE.__dict__, "seed": 3}),
                         data_dir=data_dir, out_dir=out, log=None)
  meta = sd.make_chat_dataset(bpe_workdir, "chat_sd", RECIPE, data_dir=data_dir, out_dir=out,
                              log=None)
  assert meta["splits"]["train"]["batches_resumed"] == 1 and not os.path.exists(partial)
  _assert_same_records(out, ref_out)


def test_carry_file_resumes_a_build_in_another_folder(made, bpe_workdir, data_dir, tmp_path,
                                                      monkeypatch):
  """--carry FILE: a build stopped after its first batch leaves that batch
  packed in FILE; a build into another, empty folder (another checkout)
  restores it, decodes only the rest and writes the uninterrupted build's
  records; FILE from another recipe is refused."""
  _, ref_out = made
  carry = str(tmp_path / "new_folder" / "carry.npz")      # its folder made by the build
  _stop_after_first_batch(bpe_workdir, data_dir, str(tmp_path / "a"), monkeypatch, carry=carry)
  with np.load(carry) as packed:
    assert sorted({k.split("/")[0] for k in packed.files if "/" in k}) == ["train-0-0000000"]
  with pytest.raises(data.DataError, match="another recipe"):
    sd.make_chat_dataset(bpe_workdir, "chat_sd", sd.ChatRecipe(**{**RECIPE.__dict__, "seed": 3}),
                         data_dir=data_dir, out_dir=str(tmp_path / "c"), log=None, carry=carry)
  (tmp_path / "bad.npz").write_bytes(b"not a zip")
  with pytest.raises(data.DataError, match="not a build packed by --carry"):
    sd.make_chat_dataset(bpe_workdir, "chat_sd", RECIPE, data_dir=data_dir,
                         out_dir=str(tmp_path / "d"), log=None, carry=str(tmp_path / "bad.npz"))
  out = str(tmp_path / "b")
  meta = sd.make_chat_dataset(bpe_workdir, "chat_sd", RECIPE, data_dir=data_dir, out_dir=out,
                              log=None, carry=carry)
  assert meta["splits"]["train"]["batches_resumed"] == 1
  _assert_same_records(out, ref_out)
  with np.load(carry) as packed:      # rewritten after every decoded batch
    assert len({k.split("/")[0] for k in packed.files if "/" in k}) > 1


def test_snapshot_of_a_stopped_build_is_usable_and_the_build_goes_on(made, bpe_workdir, data_dir,
                                                                    tmp_path, monkeypatch):
  """--snapshot NAME of a build stopped after its first batch: NAME holds
  exactly that batch's training answers (no training prompt decoded) and the
  whole validation split, equal to the uninterrupted build's; the build then
  resumes with the validation batches the snapshot decoded."""
  _, ref_out = made
  out = str(tmp_path)
  _stop_after_first_batch(bpe_workdir, data_dir, out, monkeypatch)
  with pytest.raises(data.DataError, match="no partial build of 'other'"):
    sd.make_chat_dataset(bpe_workdir, "other", RECIPE, data_dir=data_dir, out_dir=out, log=None,
                         snapshot="snap")
  for snap, recipe, needle in (("chat_sd", RECIPE, "must differ from --out_name"),
                               ("snap", sd.ChatRecipe(**{**RECIPE.__dict__, "seed": 3}),
                                "started with other arguments")):
    with pytest.raises(data.DataError, match=needle):
      sd.make_chat_dataset(bpe_workdir, "chat_sd", recipe, data_dir=data_dir, out_dir=out,
                           log=None, snapshot=snap)
  meta = sd.make_chat_dataset(bpe_workdir, "chat_sd", RECIPE, data_dir=data_dir, out_dir=out,
                              log=None, snapshot="snap")
  assert meta["snapshot_of"] == {"name": "chat_sd", "train_prompts_answered": RECIPE.batch_size,
                                 "train_prompts": RECIPE.chat_prompts}
  assert meta["splits"]["train"]["batches_resumed"] == 1
  got, want = _records(out, "snap"), _records(ref_out)
  assert len(got) == RECIPE.batch_size and set(got) < set(want)
  for k in got:
    np.testing.assert_array_equal(got[k], want[k])
  got, want = _records(out, "snap", "validation"), _records(ref_out, split="validation")
  assert got.keys() == want.keys()
  partial = os.path.join(out, ".chat_sd.partial")
  assert os.path.isdir(partial) and not os.path.exists(os.path.join(out, "chat_sd"))
  meta = sd.make_chat_dataset(bpe_workdir, "chat_sd", RECIPE, data_dir=data_dir, out_dir=out,
                              log=None)
  assert meta["splits"]["validation"]["batches_resumed"] >= 1 and not os.path.exists(partial)
  _assert_same_records(out, ref_out)


def test_self_written_prompts_mixed_into_training_only(made, bpe_workdir, data_dir, tmp_path):
  """--self_prompts FILE --self_prompt_share 0.4 of 5 training prompts: 2
  come from the file (their text rendered as the user turn), 3 are templated;
  validation stays templated; the recipe records the file's hash, so a
  changed file is another recipe; a recipe without them records neither
  field (datasets made before them still match)."""
  from mtp.data import self_prompts as sp
  path = str(tmp_path / "self.jsonl")
  texts = [f"Tell me a fact about the number {i}." for i in range(4)]
  sp.write_prompt_jsonl(path, [{"category": "self_written", "prompt": t} for t in texts])
  recipe = sd.ChatRecipe(**{**RECIPE.__dict__, "self_prompts": path, "self_prompt_share": 0.4})
  out = str(tmp_path / "out")
  meta = sd.make_chat_dataset(bpe_workdir, "chat_sp", recipe, data_dir=data_dir, out_dir=out,
                              log=None)
  assert meta["splits"]["train"]["categories"]["self_written"] == 2
  assert "self_written" not in meta["splits"]["validation"]["categories"]
  assert len(meta["recipe"]["self_prompts_sha256"]) == 64
  tk = tok.load_tokenizer(bpe_workdir)
  src = data.load_source(DataConfig(name="chat_sp", data_dir=out), "train")
  got = set()
  for r in range(len(src)):
    rec = src[r]
    if bytes(rec["category"]).decode() == "self_written":
      text = tk.decode(list(rec["tokens"][rec["loss_mask"] == 0]))
      got |= {t for t in texts if t in text}
  assert got == set(texts[:2])
  assert "self_prompts" not in sd.chat_recipe_json(RECIPE)
  with open(path, "a") as f:
    f.write('{"category": "self_written", "prompt": "One more."}\n')
  with pytest.raises(data.DataError, match="already exists"):
    sd.make_chat_dataset(bpe_workdir, "chat_sp", recipe, data_dir=data_dir, out_dir=out, log=None)
