"""Chat data on the real SmolLM2-135M-Instruct workdir (``make smollm``:
runs/smollm, or $MTP_SMOLLM_WORKDIR); skipped when it is absent. Part of
``make test-hf``, not needed by ``make test``."""

import os

import numpy as np
import pytest

from mtp import tokenizer as tok
from mtp.data import chat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKDIR = os.environ.get("MTP_SMOLLM_WORKDIR") or os.path.join(REPO, "runs", "smollm")
pytestmark = pytest.mark.skipif(not os.path.isdir(os.path.join(WORKDIR, "checkpoints")),
                                reason=f"no SmolLM2 workdir at {WORKDIR} (make smollm)")


@pytest.fixture(scope="module")
def smol_tok():
  return tok.load_tokenizer(WORKDIR)


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
def test_self_distill_chat_on_smollm(tmp_path, data_dir):
  from decode import self_distill as sd
  from mtp import data
  from mtp.config import DataConfig
  recipe = sd.ChatRecipe(chat_prompts=2, val_prompts=0, temperatures=(0.0,), max_new_tokens=8,
                         batch_size=2, categories=("qa",))
  meta = sd.make_chat_dataset(WORKDIR, "smol_sd", recipe, data_dir=data_dir,
                              out_dir=str(tmp_path), log=None)
  src = data.load_source(DataConfig(name="smol_sd", data_dir=str(tmp_path)), "train")
  assert len(src) == 2 and meta["splits"]["train"]["answer_tokens"] == sum(
      int(src[i]["loss_mask"].sum()) for i in range(2))
  tk = tok.load_tokenizer(WORKDIR)
  text = tk.decode(src[0]["tokens"][src[0]["loss_mask"] == 1])
  assert text.strip()                    # the model answered in words
  assert np.all(src[0]["loss_mask"][:5] == 0)
