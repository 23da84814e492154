"""Parity of the Hugging Face export with transformers' own implementation:
``LlamaForCausalLM.from_pretrained(export)`` gives our logits (float32, within
1e-4 on the ids our head can emit; the others are -inf in ours only) and our
greedy continuations; the tokenizer gives
our ids; and DeepSeek-V3's MTP-layer formula, run with transformers' Llama
decoder layer on the ``model.layers.{L + k - 1}`` tensors, gives our MTP
logits.

Needs the optional extra (``pip install -e '.[hf]'``: torch, transformers);
skipped without it, unless MTP_REQUIRE_HF=1 (``make test-hf``, CI), where a
missing package is an error.
"""

import os

import numpy as np
import pytest

if os.environ.get("MTP_REQUIRE_HF") == "1":
  import tokenizers
  import torch
  import transformers
else:
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  tokenizers = pytest.importorskip("tokenizers")

import jax.numpy as jnp
from flax import nnx
from safetensors.numpy import load_file

from decode.decoder import Decoder, SamplingParams
from mtp import export as ex
from mtp import tokenizer as tok
from tests.conftest import tiny_config
from tests.test_export import randomized_model

ATOL = 1e-4
CASES = {
    "tied_gqa_d2": dict(model=dict(tie_embeddings=True), mtp=dict(depth=2)),
    "untied_d1": dict(model=dict(tie_embeddings=False, num_heads=2, num_kv_heads=2, head_dim=16,
                                 rope_theta=5000.0, norm_eps=1e-5),
                      mtp=dict(depth=1)),
}
PROMPT_LENGTHS = (1, 6, 37, 120)          # tokens, BOS included


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """{case: (cfg, our model, export dir, transformers model)}."""
  torch.manual_seed(0)
  out = {}
  for i, (name, sections) in enumerate(CASES.items()):
    cfg = tiny_config(**sections)
    model = randomized_model(cfg, seed=10 + i)
    path = ex.write_export(model, cfg, str(tmp_path_factory.mktemp("hf") / name), step=5)
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out[name] = (cfg, model, path, hf)
  return out


@nnx.jit
def _main_logits(model, ids, positions):
  return model.head(model.backbone(ids, positions)[0])


def _prompt(rng, n) -> np.ndarray:
  return np.concatenate([[tok.BOS_ID], rng.integers(0, 256, n - 1)]).astype(np.int32)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(models, case):
  cfg, model, _, hf = models[case]
  assert isinstance(hf, transformers.LlamaForCausalLM)
  assert hf.config.rope_parameters["rope_theta"] == cfg.model.rope_theta
  rng = np.random.default_rng(0)
  for n in PROMPT_LENGTHS:
    ids = _prompt(rng, n)[None]
    # Main-head logits via backbone + head: Transformer.__call__ also runs the
    # MTP modules, which need T > D.
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    ours = np.asarray(_main_logits(model, jnp.asarray(ids), positions))
    with torch.no_grad():
      theirs = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert theirs.shape == ours.shape == (1, n, cfg.model.vocab_size)
    emittable = tok.emittable_mask(cfg.model.vocab_size)
    assert np.all(np.isneginf(ours[..., ~emittable]))          # masked: ours only
    np.testing.assert_allclose(theirs[..., emittable], ours[..., emittable],
                               atol=ATOL, rtol=0, err_msg=f"prompt length {n}")


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_continuations_match_transformers(models, case):
  cfg, model, _, hf = models[case]
  assert list(hf.generation_config.suppress_tokens) == np.flatnonzero(
      ~tok.emittable_mask(cfg.model.vocab_size)).tolist()
  rng = np.random.default_rng(1)
  prompts = [_prompt(rng, n) for n in (2, 9, 50)]
  decoder = Decoder(model, "ar", 1)
  for p in prompts:
    ours = np.asarray(decoder.generate([p], 64, SamplingParams(0.0)).tokens[0])
    with torch.no_grad():
      theirs = hf.generate(torch.tensor(p[None], dtype=torch.long), max_new_tokens=64,
                           do_sample=False)[0, len(p):].numpy()
    assert len(ours) == 64 or ours[-1] == tok.EOS_ID
    assert ours.tolist() == theirs.tolist(), f"prompt length {len(p)}"


def test_mtp_layers_follow_deepseek_v3(models):
  """Module k from the exported tensors alone, DeepSeek-V3's way:
  h' = eh_proj(cat[enorm(E(t_{i+k})), hnorm(h^{k-1}_i)]), h^k = decoder layer
  (transformers' LlamaDecoderLayer), logits = shared_head.head(shared_head.norm(h^k))."""
  from transformers.models.llama import modeling_llama as ml
  cfg, model, path, hf = models["tied_gqa_d2"]
  t = {k: torch.from_numpy(v) for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
  L, D, T = cfg.model.num_layers, cfg.model.d_model, 40
  ids = _prompt(np.random.default_rng(2), T)[None]
  ours = model(jnp.asarray(ids))
  x = torch.tensor(ids, dtype=torch.long)
  captured = {}
  hook = hf.model.layers[L - 1].register_forward_hook(
      lambda mod, args, out: captured.__setitem__("h", out[0] if isinstance(out, tuple) else out))
  with torch.no_grad():
    hf(x)
  hook.remove()
  h = captured["h"]                                              # h^0, before the final norm
  positions = torch.arange(T)[None]
  causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]

  def norm(name):
    n = ml.LlamaRMSNorm(D, eps=cfg.model.norm_eps)
    n.weight.data.copy_(t[name])
    return n

  with torch.no_grad():
    for k in range(1, cfg.mtp.depth + 1):
      p = f"model.layers.{L + k - 1}."
      layer = ml.LlamaDecoderLayer(hf.config, layer_idx=0).eval()
      layer.load_state_dict({n[len(p):]: v for n, v in t.items() if n.startswith(p) and n[len(p):]
                             in layer.state_dict()}, strict=True)
      nxt = torch.cat([x[:, k:], torch.full((1, k), tok.PAD_ID)], 1)   # t_{i+k}
      e = torch.nn.functional.embedding(nxt, t[p + "embed_tokens.weight"])
      inp = torch.cat([norm(p + "enorm.weight")(e), norm(p + "hnorm.weight")(h)], -1)
      h_in = inp @ t[p + "eh_proj.weight"].T
      out = layer(h_in, attention_mask=causal,
                  position_embeddings=hf.model.rotary_emb(h_in, positions))
      h = out[0] if isinstance(out, tuple) else out
      logits = norm(p + "shared_head.norm.weight")(h) @ t[p + "shared_head.head.weight"].T
      emittable = tok.emittable_mask(cfg.model.vocab_size)
      want = np.asarray(ours.mtp_logits[k - 1])[0, :T - k][:, emittable]
      np.testing.assert_allclose(logits[0, :T - k].numpy()[:, emittable], want, atol=ATOL,
                                 rtol=0, err_msg=f"MTP module {k}")


def test_tokenizer_gives_our_ids(models):
  _, _, path, _ = models["tied_gqa_d2"]
  hf_tok = transformers.AutoTokenizer.from_pretrained(path)
  raw = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
  ours = tok.ByteTokenizer()
  texts = ["def main(", " leading  spaces\tand\ttabs\n\n", "ünïcødé 🚀 中文 ￿", "\x00\x01\x7f",
           "".join(map(chr, range(32, 127))), "Ā" * 3 + "\r\n"]
  for text in texts:
    want = ours.encode(text, add_bos=True).tolist()
    assert hf_tok(text)["input_ids"] == want, text
    assert raw.encode(text).ids == want, text
    assert hf_tok.decode(want, skip_special_tokens=True) == text
  assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (257, 258, 256)
  assert hf_tok.convert_ids_to_tokens([256, 257, 258]) == ["<pad>", "<bos>", "<eos>"]
  # Every byte alone is its own id.
  assert [raw.encode(bytes([b]).decode("latin-1"), add_special_tokens=False).ids
          for b in range(128)] == [[b] for b in range(128)]
  assert [raw.decode([b]) for b in range(32, 127)] == [chr(b) for b in range(32, 127)]



# -- an imported (BPE) model: import -> export -> transformers / import again ----

BPE_STRINGS = [
    "Hello world", "def f(x):\n    return x ** 2  # square\n", "\tTabs\tand\n\nnewlines\r\n",
    "a  b   c    d", "Grüße, naïve café", "日本語のテキスト", "emoji 😀👍🏽", "1234567890 x=42",
    "<|im_start|>system\nYou are evil<|im_end|>", "<|endoftext|><pad>", "",
]


@pytest.fixture(scope="module")
def bpe_export(tmp_path_factory):
  """(source HF dir, imported workdir, export of that workdir): a tiny random
  ``LlamaForCausalLM`` written by transformers with a small BPE tokenizer and
  a chat template, imported by ``mtp.importers.hf``, exported by
  ``python -m mtp.export``'s library."""
  from mtp import exporting as export_run
  from mtp.importers import hf as hi
  from tests import tiny_bpe
  root = tmp_path_factory.mktemp("bpe_export")
  src = str(root / "src")
  tiny_bpe.write_tiny_hf_llama(src, seed=3)
  wd = hi.import_hf_dir(src, str(root / "wd"))
  out = export_run.export(wd, str(root / "export"))
  return src, wd, out


def _flat_params(model):
  return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_bpe_export_matches_transformers(bpe_export):
  from mtp import loading
  _, wd, out = bpe_export
  assert sorted(os.listdir(out)) == sorted([
      "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
      "tokenizer.json", "tokenizer_config.json"])
  cfg, model, _ = loading.load_model(wd)
  tk = tok.load_tokenizer(wd)
  assert cfg.model.tokenizer == "bpe" and cfg.model.never_emitted == str(tk.pad_id)
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert isinstance(hf, transformers.LlamaForCausalLM)
  emit = tok.head_mask(cfg.model)
  assert list(hf.generation_config.suppress_tokens) == np.flatnonzero(~emit).tolist()
  assert list(np.atleast_1d(hf.generation_config.eos_token_id)) == list(tk.stop_ids)
  rng = np.random.default_rng(0)
  for n in (1, 7, 40):
    ids = rng.integers(0, tk.vocab_size, (1, n)).astype(np.int32)
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    ours = np.asarray(_main_logits(model, jnp.asarray(ids), positions))
    with torch.no_grad():
      theirs = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.all(np.isneginf(ours[..., ~emit]))               # masked: ours only
    np.testing.assert_allclose(theirs[..., emit], ours[..., emit], atol=ATOL, rtol=0,
                               err_msg=f"prompt length {n}")
  # greedy continuations: ours (AR Decoder, stop ids) == generate with the export's
  # generation_config (suppress_tokens, every stop id as eos)
  prompt = tk.apply_chat_template([{"role": "user", "content": "hello world"}])
  ours = np.asarray(Decoder(model, "ar", 1, tokenizer=tk).generate(
      [prompt], 48, SamplingParams(0.0)).tokens[0]).tolist()
  with torch.no_grad():
    theirs = hf.generate(torch.tensor(prompt[None], dtype=torch.long), max_new_tokens=48,
                         do_sample=False,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
  assert ours == theirs[0, len(prompt):].tolist()


def test_bpe_export_tokenizer_gives_our_ids(bpe_export):
  _, wd, out = bpe_export
  ours = tok.load_tokenizer(wd)
  back = tok.load_tokenizer(out)                 # the export's own (config.json's mtp entry)
  assert back.kind == "bpe" and back.to_dict() == ours.to_dict()
  htk = transformers.AutoTokenizer.from_pretrained(out)
  assert (htk.bos_token_id, htk.eos_token_id, htk.pad_token_id) == (
      ours.bos_id, ours.eos_id, ours.pad_id)
  for s in BPE_STRINGS:
    want = ours.encode(s).tolist()
    assert htk(s, add_special_tokens=False, split_special_tokens=True).input_ids == want, s
    assert back.encode(s).tolist() == want, s
    assert htk.decode(want) == ours.decode(want) == s, s
  msgs = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "hi"},
          {"role": "user", "content": "Grüße 😀"}]
  theirs = htk.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
  theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
  assert ours.apply_chat_template(msgs).tolist() == theirs
  assert back.apply_chat_template(msgs).tolist() == theirs


def test_bpe_export_imports_back_bitwise(bpe_export, tmp_path):
  """Importing the export (``mtp.importers.hf``), or loading it as a model
  directory (``mtp.loading``), gives the workdir's parameters bit for bit."""
  from mtp import loading
  from mtp.importers import hf as hi
  _, wd, out = bpe_export
  cfg, model, _ = loading.load_model(wd)
  want = _flat_params(model)
  again = hi.import_hf_dir(out, str(tmp_path / "again"))
  cfg2, model2, _ = loading.load_model(again)
  cfg3, model3, step = loading.load_model(out)
  assert step == 0
  for c in (cfg2, cfg3):
    assert c.model == cfg.model and c.mtp.depth == cfg.mtp.depth
  for m in (model2, model3):
    got = _flat_params(m)
    assert set(got) == set(want)
    for p in want:
      assert got[p].dtype == want[p].dtype and np.array_equal(got[p], want[p]), p
  assert tok.load_tokenizer(again).to_dict() == tok.load_tokenizer(wd).to_dict()
