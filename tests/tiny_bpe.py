"""Test helpers: a small byte-level BPE trained in the test, its GGUF
metadata, random Llama tensors, and a GGUF writer (``gguf.GGUFWriter``)
that stores them the way llama.cpp's converter does (Q/K rows permuted to
the interleaved-RoPE order, a chosen tensor type per tensor)."""

from __future__ import annotations

import json

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = [
    "def main(argv):\n    return 0\n", "import os\nimport sys\n", "hello world, hello there",
    "The quick brown fox jumps over the lazy dog.", "for i in range(10):\n    print(i)\n",
    "Grüße aus Köln, naïve café", "日本語のテキスト", "emoji 😀 and 👍", "    indented    spaces",
] * 4


def train_tiny_bpe(vocab_size: int = 320):
  """A ``tokenizers`` byte-level BPE (the 256 byte symbols, merges learned on
  ``CORPUS``, ``SPECIALS`` first as special tokens), GPT-2 style."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tk = Tokenizer(models.BPE())
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tk.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tk.train_from_iterator(CORPUS, trainer)
  return tk


def gguf_tokenizer_metadata(tk, pre: str = "default") -> dict:
  """The GGUF ``tokenizer.*`` metadata of a trained ``tokenizers`` BPE, as
  llama.cpp's converter writes it (tokens by id, merges "a b", types)."""
  model = json.loads(tk.to_str())["model"]
  vocab = tk.get_vocab(with_added_tokens=True)
  tokens = [None] * len(vocab)
  for t, i in vocab.items():
    tokens[i] = t
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  types = [3 if t in SPECIALS else 1 for t in tokens]
  return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
          "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.bos_token_id": vocab["<|im_start|>"],
          "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
          "tokenizer.ggml.padding_token_id": vocab["<pad>"],
          "tokenizer.ggml.add_bos_token": False,
          "tokenizer.chat_template": CHAT_TEMPLATE}


def random_llama_tensors(*, vocab: int, d: int, layers: int, heads: int, kv: int, hd: int,
                         ff: int, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
  """Random HF-layout Llama tensors (float32; Q/K rows in rotate-half order)."""
  rng = np.random.default_rng(seed)
  n = lambda *s: (rng.normal(size=s) / np.sqrt(s[-1])).astype(np.float32)
  t = {"model.embed_tokens.weight": n(vocab, d),
       "model.norm.weight": (1 + 0.2 * rng.normal(size=d)).astype(np.float32)}
  if not tied:
    t["lm_head.weight"] = n(vocab, d)
  for i in range(layers):
    p = f"model.layers.{i}"
    t[f"{p}.input_layernorm.weight"] = (1 + 0.2 * rng.normal(size=d)).astype(np.float32)
    t[f"{p}.post_attention_layernorm.weight"] = (1 + 0.2 * rng.normal(size=d)).astype(np.float32)
    t[f"{p}.self_attn.q_proj.weight"] = n(heads * hd, d)
    t[f"{p}.self_attn.k_proj.weight"] = n(kv * hd, d)
    t[f"{p}.self_attn.v_proj.weight"] = n(kv * hd, d)
    t[f"{p}.self_attn.o_proj.weight"] = n(d, heads * hd)
    t[f"{p}.mlp.gate_proj.weight"] = n(ff, d)
    t[f"{p}.mlp.up_proj.weight"] = n(ff, d)
    t[f"{p}.mlp.down_proj.weight"] = n(d, ff)
  return t


_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
            "output_norm.weight", "lm_head.weight": "output.weight"}
_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
  if hf in _TO_GGUF:
    return _TO_GGUF[hf]
  parts = hf.split(".")
  return f"blk.{parts[2]}.{_BLOCK['.'.join(parts[3:-1])]}.weight"


def write_gguf(path: str, tensors: dict[str, np.ndarray], *, heads: int, kv: int, hd: int,
               layers: int, d: int, ff: int, ctx: int = 256, theta: float = 10000.0,
               eps: float = 1e-5, tokenizer_meta: dict | None = None,
               types: dict[str, str] | None = None, default_type: str = "F32",
               arch: str = "llama", extra_meta: dict | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
  """Writes a llama GGUF of HF ``tensors`` (Q/K permuted as llama.cpp does;
  each tensor stored as ``types.get(hf_name, default_type)``; 1-D tensors
  always F32). Returns the float32 HF tensors the file really holds after
  quantization (Q/K back in rotate-half order): what an import must give."""
  import gguf
  from gguf import GGMLQuantizationType as Q
  from mtp.importers.gguf import permute_qk, unpermute_qk
  w = gguf.GGUFWriter(path, arch)
  w.add_block_count(layers)
  w.add_context_length(ctx)
  w.add_embedding_length(d)
  w.add_feed_forward_length(ff)
  w.add_head_count(heads)
  w.add_head_count_kv(kv)
  w.add_rope_freq_base(theta)
  w.add_layer_norm_rms_eps(eps)
  w.add_rope_dimension_count(hd)
  w.add_vocab_size(tensors["model.embed_tokens.weight"].shape[0])
  meta = dict(tokenizer_meta or {})
  meta.update(extra_meta or {})
  for key, value in meta.items():
    if key == "tokenizer.ggml.tokens":
      w.add_token_list(value)
    elif key == "tokenizer.ggml.merges":
      w.add_token_merges(value)
    elif key == "tokenizer.ggml.token_type":
      w.add_token_types(value)
    elif isinstance(value, bool):
      w.add_bool(key, value)
    elif isinstance(value, int):
      w.add_uint32(key, value)
    elif isinstance(value, float):
      w.add_float32(key, value)
    else:
      w.add_string(key, value)
  held = {}
  for hf, x in tensors.items():
    x = np.asarray(x, np.float32)
    if ".q_proj." in hf:
      x = permute_qk(x, heads)
    elif ".k_proj." in hf:
      x = permute_qk(x, kv)
    kind = "F32" if x.ndim == 1 else (types or {}).get(hf, default_type)
    if kind == "F32":
      w.add_tensor(gguf_name(hf), x)
      stored = x
    elif kind == "F16":
      w.add_tensor(gguf_name(hf), x.astype(np.float16))
      stored = x.astype(np.float16).astype(np.float32)
    else:
      q = gguf.quants.quantize(x, Q[kind])
      w.add_tensor(gguf_name(hf), q, raw_shape=q.shape, raw_dtype=Q[kind])
      stored = gguf.quants.dequantize(q, Q[kind]).reshape(x.shape).astype(np.float32)
    if ".q_proj." in hf:
      stored = unpermute_qk(stored, heads)
    elif ".k_proj." in hf:
      stored = unpermute_qk(stored, kv)
    held[hf] = stored
  for name, x in (extra_tensors or {}).items():
    w.add_tensor(name, np.asarray(x, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return held


def import_tiny_workdir(folder: str, *, vocab: int = 320, ctx: int = 1024, mtp_depth: int = 0,
                        seed: int = 0) -> str:
  """A workdir imported (``mtp.importers.gguf.import_gguf``) from a random
  2-layer Llama GGUF with the tiny BPE tokenizer (its ChatML-like template;
  ``<|im_end|>`` the end-of-turn / stop id) in ``folder``; returns its path."""
  import os
  from mtp.importers import gguf as gi
  meta = gguf_tokenizer_metadata(train_tiny_bpe(300))
  dims = dict(heads=4, kv=2, hd=8, layers=2, d=32, ff=64)
  tensors = random_llama_tensors(vocab=vocab, d=32, layers=2, heads=4, kv=2, hd=8, ff=64,
                                 tied=True, seed=seed)
  path = os.path.join(folder, "m.gguf")
  write_gguf(path, tensors, tokenizer_meta=meta, ctx=ctx, **dims)
  return gi.import_gguf(path, os.path.join(folder, "wd"), mtp_depth=mtp_depth)


def write_tiny_hf_llama(path: str, *, seed: int = 3, tie: bool = False, vocab_size: int = 300,
                        padding: int = 20):
  """A tiny random ``LlamaForCausalLM`` written by transformers to ``path``
  (safetensors, config, generation config) with ``train_tiny_bpe``'s
  tokenizer and ``CHAT_TEMPLATE`` (``PreTrainedTokenizerFast.save_pretrained``):
  GQA (4 query / 2 KV heads), ``padding`` ids past the tokenizer, norms not
  all ones. Needs torch and transformers. Returns the transformers model."""
  import torch
  import transformers
  bpe = train_tiny_bpe(vocab_size)
  ids = {name: bpe.token_to_id(name) for name in ("<|im_start|>", "<|im_end|>", "<pad>")}
  config = transformers.LlamaConfig(
      vocab_size=bpe.get_vocab_size() + padding, hidden_size=64, intermediate_size=96,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
      max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=5000.0,
      tie_word_embeddings=tie, initializer_range=0.2, bos_token_id=ids["<|im_start|>"],
      eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<pad>"])
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():                    # non-trivial norms
    for n, p in model.named_parameters():
      if n.endswith("norm.weight"):
        p.add_(0.2 * torch.randn_like(p))
  model.save_pretrained(path)
  transformers.PreTrainedTokenizerFast(
      tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<pad>",
      chat_template=CHAT_TEMPLATE).save_pretrained(path)
  return model
