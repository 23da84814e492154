"""mtp.export without torch: the files, the mapping table (DeepSeek-V3 MTP
naming and eh_proj order), bitwise import, refusals and bad input. The
transformers parity tests are in tests/test_export_hf.py."""

import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from mtp import checkpoint as ckpt_lib
from mtp import loading
from mtp import export as ex
from mtp import exporting as export_run
from mtp import tokenizer as tok
from mtp.model import build_model
from tests.conftest import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {
    # tied head, GQA, D = 2, non-default RoPE base and epsilon
    "tied": dict(model=dict(tie_embeddings=True, rope_theta=5000.0, norm_eps=1e-5),
                 mtp=dict(depth=2)),
    # untied head, no GQA, D = 1, bfloat16 parameters
    "untied_bf16": dict(model=dict(tie_embeddings=False, num_kv_heads=4, param_dtype="bfloat16",
                                   dtype="bfloat16"), mtp=dict(depth=1)),
    "plain": dict(mtp=dict(depth=0)),
}


def randomized_model(cfg, seed=0):
  """``build_model(cfg)`` with every parameter perturbed (RMSNorm scales
  1 + N(0, 0.2^2) instead of all ones), so that swapping any two tensors of
  the same shape changes the model."""
  model = build_model(cfg, seed=seed)
  rng = np.random.default_rng(seed + 100)
  state = nnx.state(model, nnx.Param)
  for path, var in nnx.to_flat_state(state):
    x = np.asarray(var[...], np.float32)
    noise = rng.normal(size=x.shape).astype(np.float32)
    x = x + (0.2 * noise if path[-1] == "scale" else 0.5 * x.std() * noise)
    var[...] = jnp.asarray(x, var[...].dtype)
  nnx.update(model, state)
  return model


def _save_workdir(path, cfg, seed=0, step=3):
  model = randomized_model(cfg, seed=seed)
  ckpt = ckpt_lib.Checkpointer(str(path))
  ckpt.save(step, nnx.state(model, nnx.Param), {}, None, cfg)
  ckpt.close()
  return model


def _params(model) -> dict:
  return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """{case: (cfg, model, workdir, export dir)} for every CASE."""
  root = tmp_path_factory.mktemp("export")
  out = {}
  for i, (name, sections) in enumerate(CASES.items()):
    cfg = tiny_config(**sections)
    model = _save_workdir(root / f"wd_{name}", cfg, seed=i)
    path = export_run.export(str(root / f"wd_{name}"), str(root / f"hf_{name}"))
    out[name] = (cfg, model, str(root / f"wd_{name}"), path)
  return out


@pytest.mark.parametrize("case", list(CASES))
def test_import_round_trips_bitwise(exported, case):
  cfg, model, _, path = exported[case]
  cfg2, model2, step = ex.load_exported(path)
  assert cfg2 == cfg and step == 3
  want, got = _params(model), _params(model2)
  assert want.keys() == got.keys()
  for p in want:
    assert got[p].dtype == want[p].dtype and np.array_equal(got[p], want[p]), p
  # The decode path: load_model accepts the export in place of a workdir.
  cfg3, model3, step3 = loading.load_model(path)
  assert cfg3 == cfg and step3 == 3
  assert all(np.array_equal(v, want[p]) for p, v in _params(model3).items())
  if case != "tied":
    return
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 259, (2, 12)), jnp.int32)
  forward = nnx.jit(lambda m, t: (lambda o: (o.logits, o.mtp_logits))(m(t)))   # one program
  (a, a_mtp), (b, b_mtp) = forward(model, tokens), forward(model3, tokens)
  assert np.array_equal(np.asarray(a), np.asarray(b))
  for x, y in zip(a_mtp, b_mtp):
    assert np.array_equal(np.asarray(x), np.asarray(y))


def test_one_loader_tells_a_workdir_from_an_export(exported):
  """mtp.loading: kind, config and parameters of a workdir and of its
  export agree; train.init_from may name either (parameters placed in the
  trainer's shardings, bitwise equal)."""
  from train import workdir as workdir_lib
  from train.loop import Trainer
  cfg, model, workdir, path = exported["tied"]
  assert loading.kind(workdir) == loading.WORKDIR and loading.kind(path) == loading.EXPORTED
  assert loading.load_config(workdir) == loading.load_config(path) == (cfg, 3)
  with pytest.raises(ckpt_lib.CheckpointError, match="exported model.*step=3 cannot be chosen"):
    loading.load_config(path, 3)
  trainer = Trainer(cfg)
  want = _params(model)
  for src in (workdir, path):
    stage = cfg.replace(train=dict(init_from=src))
    step = workdir_lib.check_init_from(stage)
    params = workdir_lib.restore_init_params(trainer.abstract_params, src, step)
    got = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(params)}
    assert got.keys() == want.keys() and all(np.array_equal(got[p], want[p]) for p in want), src


def test_files_config_and_tensor_names(exported):
  cfg, model, _, path = exported["tied"]
  assert sorted(os.listdir(path)) == sorted([
      "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
      "tokenizer.json", "tokenizer_config.json"])
  hf = json.load(open(os.path.join(path, "config.json")))
  m = cfg.model
  assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
  assert (hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"],
          hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]) == (
              m.vocab_size, m.d_model, m.mlp_dim, m.num_layers, m.num_heads, m.num_kv_heads,
              m.head_dim)
  assert hf["rope_parameters"] == {"rope_type": "default", "rope_theta": 5000.0}
  assert hf["rms_norm_eps"] == 1e-5 and hf["tie_word_embeddings"] is True
  assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (257, 258, 256)
  assert hf["num_nextn_predict_layers"] == 2 and hf["mtp"]["step"] == 3
  gen = json.load(open(os.path.join(path, "generation_config.json")))
  never = sorted(set(tok.NEVER_EMITTED_IDS) | set(range(259, m.vocab_size)))
  assert gen["suppress_tokens"] == never and 0xFF in never and tok.EOS_ID not in never
  tensors = load_file(os.path.join(path, "model.safetensors"))
  L, D = m.num_layers, m.d_model
  assert "lm_head.weight" not in tensors                      # tied
  assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (m.num_heads * m.head_dim, D)
  assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (m.num_kv_heads * m.head_dim, D)
  assert tensors["model.layers.1.mlp.down_proj.weight"].shape == (D, m.mlp_dim)
  # MTP module k is decoder layer L + k - 1 under DeepSeek-V3's names.
  for k in (1, 2):
    layer = f"model.layers.{L + k - 1}"
    for name in ("enorm", "hnorm", "shared_head.norm"):
      assert tensors[f"{layer}.{name}.weight"].shape == (D,)
    assert tensors[f"{layer}.eh_proj.weight"].shape == (D, 2 * D)
    assert tensors[f"{layer}.self_attn.o_proj.weight"].shape == (D, m.num_heads * m.head_dim)
    assert np.array_equal(tensors[f"{layer}.embed_tokens.weight"],
                          tensors["model.embed_tokens.weight"])
    assert np.array_equal(tensors[f"{layer}.shared_head.head.weight"],
                          tensors["model.embed_tokens.weight"])
    assert np.array_equal(tensors[f"{layer}.enorm.weight"], _params(model)[("mtp", k - 1,
                                                                            "embed_norm", "scale")])
  assert f"model.layers.{L + 2}.enorm.weight" not in tensors
  assert set(tensors) == {r.hf_name for r in ex.hf_name_map(m, 2)}
  # Untied: lm_head.weight is the head kernel transposed, and the MTP copy
  # of the head is that tensor.
  cfg_u, model_u, _, path_u = exported["untied_bf16"]
  t_u = load_file(os.path.join(path_u, "model.safetensors"))
  head = _params(model_u)[("lm_head", "kernel")]
  assert t_u["lm_head.weight"].dtype == head.dtype and np.array_equal(t_u["lm_head.weight"], head.T)
  assert np.array_equal(t_u[f"model.layers.{L}.shared_head.head.weight"], head.T)


def _rms(x, w, eps):
  x = x.astype(np.float64)
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def test_eh_proj_follows_deepseek_input_order(exported):
  """DeepSeek-V3's MTP layer computes eh_proj(cat[enorm(e), hnorm(h)]); ours
  proj(cat[hidden_norm(h), embed_norm(e)]). Recompute DeepSeek's formula from
  the exported tensors alone and compare with our module's projection."""
  cfg, model, _, path = exported["tied"]
  t = load_file(os.path.join(path, "model.safetensors"))
  rng = np.random.default_rng(1)
  h = rng.normal(size=(3, cfg.model.d_model)).astype(np.float32)
  e = rng.normal(size=(3, cfg.model.d_model)).astype(np.float32) * 0.1
  eps = cfg.model.norm_eps
  for k in (1, 2):
    layer = f"model.layers.{cfg.model.num_layers + k - 1}"
    theirs = np.concatenate([_rms(e, t[f"{layer}.enorm.weight"], eps),
                             _rms(h, t[f"{layer}.hnorm.weight"], eps)], -1) @ t[
                                 f"{layer}.eh_proj.weight"].T.astype(np.float64)
    mod = model.mtp[k - 1]
    ours = mod.proj(jnp.concatenate([mod.hidden_norm(jnp.asarray(h)),
                                     mod.embed_norm(jnp.asarray(e))], -1))
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-4, atol=1e-5)
    # Inputs and norm weights differ, so a swapped order or name would show.
    assert not np.allclose(t[f"{layer}.enorm.weight"], t[f"{layer}.hnorm.weight"], atol=0.05)


def test_tokenizer_vocab_maps_bytes_to_our_ids():
  files = ex.tokenizer_files()
  vocab = files["tokenizer.json"]["model"]["vocab"]
  byte_chars = ex.bytes_to_unicode()
  assert len(set(byte_chars.values())) == 256
  assert all(vocab[byte_chars[b]] == b for b in range(256))
  assert {vocab[n]: n for n in ("<pad>", "<bos>", "<eos>")} == tok.SPECIAL_NAMES
  added = {a["id"]: a["content"] for a in files["tokenizer.json"]["added_tokens"]}
  assert added == tok.SPECIAL_NAMES
  assert files["special_tokens_map.json"] == {"bos_token": "<bos>", "eos_token": "<eos>",
                                              "pad_token": "<pad>"}


def test_unsupported_settings_are_refused_naming_the_field(exported, tmp_path):
  import dataclasses
  from mtp.config import Config, ModelConfig

  @dataclasses.dataclass(frozen=True)
  class WithQkNorm(ModelConfig):
    qk_norm: bool = True

  cfg = exported["tied"][0]
  with pytest.raises(ex.ExportError, match=r"model\.qk_norm=True has no LlamaForCausalLM "
                                           r"equivalent"):
    ex.check_exportable(Config(model=WithQkNorm(), mtp=cfg.mtp))
  # Import refuses Llama features mtp.model does not have, naming the field.
  src = exported["plain"][3]
  for key, value in (("attention_bias", True), ("hidden_act", "gelu"), ("bos_token_id", 1),
                     ("rope_parameters", {"rope_type": "linear", "factor": 2.0,
                                          "rope_theta": 1e4})):
    bad = tmp_path / key
    os.makedirs(bad)
    for f in os.listdir(src):
      os.symlink(os.path.join(src, f), bad / f)
    hf = json.load(open(os.path.join(src, "config.json")))
    os.unlink(bad / "config.json")
    json.dump({**hf, key: value}, open(bad / "config.json", "w"))
    with pytest.raises(ex.ExportError, match=key):
      ex.load_exported(str(bad))


def test_import_rejects_bad_tensors(exported, tmp_path):
  cfg, _, _, src = exported["tied"]
  tensors = load_file(os.path.join(src, "model.safetensors"))
  L = cfg.model.num_layers

  def load_with(tensors):
    d = tmp_path / f"d{len(os.listdir(tmp_path))}"
    os.makedirs(d)
    for f in os.listdir(src):
      if f != "model.safetensors":
        os.symlink(os.path.join(src, f), d / f)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return ex.load_exported(str(d))

  name = f"model.layers.{L}.eh_proj.weight"
  with pytest.raises(ex.ExportError, match=f"no tensor '{name}'"):
    load_with({k: v for k, v in tensors.items() if k != name})
  with pytest.raises(ex.ExportError, match=r"tensor 'model\.layers\.9\.enorm\.weight'"):
    load_with({**tensors, "model.layers.9.enorm.weight": tensors[f"model.layers.{L}.enorm.weight"]})
  with pytest.raises(ex.ExportError, match=f"'{name}' has shape \\(64, 32\\).*expected "
                                           r"\(32, 64\)"):
    load_with({**tensors, name: np.ascontiguousarray(tensors[name].T)})
  nan = tensors["model.norm.weight"].copy()
  nan[3] = np.nan
  with pytest.raises(ex.ExportError, match=r"'model\.norm\.weight' \(32,\) holds 1 non-finite"):
    load_with({**tensors, "model.norm.weight": nan})
  copy = f"model.layers.{L}.shared_head.head.weight"
  with pytest.raises(ex.ExportError, match=f"'{copy}' differs from 'model.embed_tokens.weight'"):
    load_with({**tensors, copy: tensors[copy] + 1})
  with pytest.raises(ckpt_lib.CheckpointError, match="not an exported model|no checkpoint"):
    loading.load_model(str(tmp_path / "nothing_here"))


def _tmp_leftovers(parent) -> list[str]:
  return [f for f in os.listdir(parent) if ".tmp-" in f or ".old-" in f]


def test_output_directory_rules(exported, tmp_path, monkeypatch):
  cfg, model, workdir, _ = exported["plain"]
  out = tmp_path / "out"
  export_run.export(workdir, str(out))
  before = {f: open(out / f, "rb").read() for f in os.listdir(out)}
  with pytest.raises(ex.ExportError, match=r"--out=.*already exists; pass --overwrite"):
    export_run.export(workdir, str(out))
  export_run.export(workdir, str(out), overwrite=True)                 # replaces an earlier export
  assert {f: open(out / f, "rb").read() for f in os.listdir(out)} == before
  # --overwrite never deletes a folder the exporter did not write.
  foreign = tmp_path / "mine"
  foreign.mkdir()
  (foreign / "notes.txt").write_text("keep me")
  with pytest.raises(ex.ExportError, match="not an earlier export .*notes.txt.*refusing"):
    export_run.export(workdir, str(foreign), overwrite=True)
  assert (foreign / "notes.txt").read_text() == "keep me"
  with pytest.raises(ex.ExportError, match="parent directory .* does not exist"):
    export_run.export(workdir, str(tmp_path / "no" / "such" / "out"))
  with pytest.raises(ckpt_lib.CheckpointError, match="no checkpoint in workdir"):
    export_run.export(str(tmp_path / "empty_workdir"), str(tmp_path / "never"))
  assert not (tmp_path / "never").exists()
  # A failure while writing leaves nothing half-written: no new folder, and
  # an existing export stays as it was.
  def boom(*a, **k):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(ex, "_write_json", boom)
  with pytest.raises(OSError, match="No space left"):
    export_run.export(workdir, str(tmp_path / "fresh"))
  assert not (tmp_path / "fresh").exists()
  with pytest.raises(OSError, match="No space left"):
    export_run.export(workdir, str(out), overwrite=True)
  assert {f: open(out / f, "rb").read() for f in os.listdir(out)} == before
  assert not _tmp_leftovers(tmp_path)


def _tree(path) -> dict:
  """Every file under ``path`` (relative name -> bytes)."""
  out = {}
  for root, _, files in os.walk(path):
    for f in files:
      full = os.path.join(root, f)
      out[os.path.relpath(full, path)] = open(full, "rb").read()
  return out


@pytest.mark.cpu_only
def test_overwrite_never_deletes_a_workdir(exported, tmp_path):
  """--overwrite replaces only an earlier export: never the workdir being
  exported (or a folder holding it), never another training run, even one
  whose config.json has an 'mtp' entry (every workdir's has)."""
  _, _, workdir, _ = exported["plain"]
  src = tmp_path / "run_a"
  shutil.copytree(workdir, src)
  (src / "metrics.jsonl").write_text('{"step": 3, "split": "train"}\n')
  with open(src / "config.json", "w") as f:          # a training workdir's config.json
    json.dump({"mtp": {"depth": 0}, "model": {}}, f)
  before = _tree(src)
  for out in (src, tmp_path):                          # itself, a folder that holds it
    with pytest.raises(ex.ExportError, match="contains, the --workdir being exported"):
      export_run.export(str(src), str(out), overwrite=True)
  other = tmp_path / "run_b"
  shutil.copytree(src, other)
  with pytest.raises(ex.ExportError, match="not an earlier export .*checkpoints.*refusing"):
    export_run.export(str(src), str(other), overwrite=True)
  # An export with one extra file in it is not replaced either.
  out = tmp_path / "hf"
  export_run.export(str(src), str(out))
  (out / "README.md").write_text("mine")
  with pytest.raises(ex.ExportError, match="README.md"):
    export_run.export(str(src), str(out), overwrite=True)
  assert _tree(src) == before and _tree(other) == before
  assert (out / "README.md").read_text() == "mine"
  r = subprocess.run([sys.executable, "-m", "mtp.export", "--workdir", str(src), "--out", str(src),
                      "--overwrite"], cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
  assert _tree(src) == before


@pytest.mark.cpu_only
def test_cli(exported, tmp_path):
  _, _, workdir, _ = exported["tied"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  run = lambda *args: subprocess.run([sys.executable, "-m", "mtp.export", *args], cwd=REPO,
                                     env=env, capture_output=True, text=True, timeout=300)
  r = run("--workdir", workdir, "--out", str(tmp_path / "hf"))
  assert r.returncode == 0, r.stderr[-2000:]
  assert f"wrote {tmp_path / 'hf'}" in r.stdout and ex.is_exported(str(tmp_path / "hf"))
  r = run("--workdir", str(tmp_path / "nope"), "--out", str(tmp_path / "hf2"))
  assert r.returncode == 2 and "error: no checkpoint in workdir" in r.stderr, r.stderr[-2000:]
  assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "hf2").exists()


def test_bpe_model_exports_its_tokenizer(tmp_path):
  """A BPE model (``model.tokenizer = "bpe"``, as imported) exports its own
  tokenizer (BOS post-processor when it adds BOS, names, chat template),
  every stop id in generation_config, and reads back bitwise with the same
  tokenizer; without its tokenizer the export is refused. (Parity with
  transformers: tests/test_export_hf.py.)"""
  from mtp import bpe
  from tests.tiny_bpe import gguf_tokenizer_metadata, train_tiny_bpe
  meta = gguf_tokenizer_metadata(train_tiny_bpe(300))
  meta["tokenizer.ggml.add_bos_token"] = True
  meta["tokenizer.ggml.eot_token_id"] = 0                   # <|endoftext|>: a second stop id
  tk = bpe.BPETokenizer.from_gguf_metadata(meta)
  cfg = tiny_config(model=dict(vocab_size=320, tokenizer="bpe", num_tokens=tk.vocab_size,
                               never_emitted=str(tk.pad_id)), mtp=dict(depth=1))
  model = randomized_model(cfg, seed=4)
  with pytest.raises(ex.ExportError, match="model.tokenizer='bpe'"):
    ex.write_export(model, cfg, str(tmp_path / "none"))
  with pytest.raises(ex.ExportError, match="model.tokenizer='bpe'"):
    ex.write_export(model, cfg, str(tmp_path / "byte"), tokenizer=tok.ByteTokenizer())
  with pytest.raises(ex.ExportError, match="model.num_tokens"):
    ex.write_export(model, tiny_config(model=dict(vocab_size=320, tokenizer="bpe", num_tokens=200)),
                    str(tmp_path / "short"), tokenizer=tk)
  assert not os.listdir(tmp_path)
  out = ex.write_export(model, cfg, str(tmp_path / "bpe"), step=3, tokenizer=tk)
  read = lambda name: json.load(open(os.path.join(out, name)))
  hf, gen, tc = read("config.json"), read("generation_config.json"), read("tokenizer_config.json")
  assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (tk.bos_id, tk.eos_id,
                                                                          tk.pad_id)
  assert hf["mtp"]["tokenizer"] == tk.to_dict()
  assert gen["eos_token_id"] == sorted(tk.stop_ids) and len(tk.stop_ids) == 2
  assert gen["suppress_tokens"] == [tk.pad_id] + list(range(tk.vocab_size, 320))
  assert (tc["bos_token"], tc["eos_token"], tc["pad_token"]) == ("<|im_start|>", "<|im_end|>",
                                                                 "<pad>")
  assert tc["add_bos_token"] is True and tc["chat_template"] == tk.chat_template
  import tokenizers
  raw = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
  for text in ("hello world", "def main(argv):\n    return 0\n", "Grüße 😀"):
    assert raw.encode(text).ids == tk.encode(text).tolist()       # BOS prepended on both
    assert tk.encode(text).tolist()[0] == tk.bos_id
  back = tok.load_tokenizer(out)
  assert back.to_dict() == tk.to_dict()
  msgs = [{"role": "user", "content": "<|im_start|>hi"}]
  assert back.apply_chat_template(msgs).tolist() == tk.apply_chat_template(msgs).tolist()
  cfg2, model2, step = loading.load_model(out)
  assert step == 3 and cfg2.model == cfg.model and cfg2.mtp.depth == 1
  for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                            nnx.to_flat_state(nnx.state(model2, nnx.Param))):
    assert np.array_equal(np.asarray(a[...]), np.asarray(b[...])), p
  # exporting the export again (python -m mtp.export --workdir EXPORT) gives the same files
  again = export_run.export(out, str(tmp_path / "again"))
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    assert read(name) == json.load(open(os.path.join(again, name))), name
  assert open(os.path.join(out, "model.safetensors"), "rb").read() == open(
      os.path.join(again, "model.safetensors"), "rb").read()


def test_init_from_a_draft_vocabulary_of_another_size(tmp_path):
  """train.init_from a stage with V' = 48 into one with V' = 32: every other
  parameter restored bitwise, V' left as a placeholder for this run's data to
  fill (``train.loop.attach_draft_vocab``); dropping V' (size 0) is refused."""
  from mtp import draft_vocab as dv
  from train import workdir as workdir_lib
  from train.loop import Trainer
  cfg = tiny_config(mtp=dict(depth=1, draft_vocab_size=48))
  model = randomized_model(cfg)
  dv.set_draft_vocab(model, np.arange(40, 136, 2, dtype=np.int32))
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "wd"))
  ckpt.save(3, nnx.state(model, nnx.Param), {}, None, cfg)
  ckpt.close()
  src = str(tmp_path / "wd")
  stage = cfg.replace(mtp=dict(draft_vocab_size=32), train=dict(init_from=src))
  step = workdir_lib.check_init_from(stage)
  params = workdir_lib.restore_init_params(Trainer(stage).abstract_params, src, step)
  got = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(params)}
  want = _params(model)
  assert got.keys() == want.keys()
  np.testing.assert_array_equal(got.pop(("draft_vocab",)), np.arange(32))
  assert all(np.array_equal(got[p], want[p]) for p in got)
  with pytest.raises(ckpt_lib.CheckpointError, match="draft_vocab_size"):
    workdir_lib.check_init_from(cfg.replace(mtp=dict(draft_vocab_size=0),
                                            train=dict(init_from=src)))
