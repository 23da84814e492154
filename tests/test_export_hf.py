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

from decode.speculative import Decoder, SamplingParams
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

