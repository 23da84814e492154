"""The MTP modules file (``mtp.export.modules``): a workdir's trained MTP
modules and draft vocabulary written by ``python -m mtp.export --modules_out``
and attached to a freshly imported target by ``python -m mtp.importers
--mtp_modules`` (``mtp.importers.attach``). A tiny random GGUF target
(tests/tiny_bpe.py), a D = 1 source with V' and recursive steps, checkpoints
at steps 5 and 7."""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

import jax.numpy as jnp
from flax import nnx

from decode.auto import calibrate
from decode.decoder import Decoder, SamplingParams
from mtp import checkpoint as ckpt_lib
from mtp import draft_vocab as dv
from mtp import export as export_lib
from mtp import loading
from mtp import tokenizer as tok
from mtp.export import modules
from mtp import exporting as export_run
from mtp.importers import ModelImportError, params_from_hf_tensors
from mtp.importers import __main__ as cli
from mtp.importers import gguf as gi
from mtp.importers import hf as hi
from tests import tiny_bpe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIMS = dict(heads=4, kv=2, hd=8, layers=2, d=32, ff=64)
VOCAB = 320
SIZE = 24                     # |V'|
GREEDY = SamplingParams(temperature=0.0)


def _eval_row(step, a1):
  return {"step": step, "split": "eval", "loss": 3.0, "mtp_1/teacher_agreement": a1,
          "mtp_1/teacher_agreement_full": a1 - 0.01, "mtp_1/teacher_overlap": a1 - 0.1}


def _flat(model):
  return {tuple(p): np.asarray(v.get_value()) for p, v in
          nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _write_gguf(path, tok_meta, seed=0, dims=DIMS):
  t = tiny_bpe.random_llama_tensors(vocab=VOCAB, d=dims["d"], layers=dims["layers"],
                                    heads=dims["heads"], kv=dims["kv"], hd=dims["hd"],
                                    ff=dims["ff"], tied=True, seed=seed)
  return tiny_bpe.write_gguf(str(path), t, tokenizer_meta=tok_meta, **dims)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  """The target GGUF, a source workdir (checkpoints 5 and 7 with different
  modules, metrics rows), and modules files: bf16 of step 7, f32 of step 5."""
  root = tmp_path_factory.mktemp("modules")
  tok_meta = tiny_bpe.gguf_tokenizer_metadata(tiny_bpe.train_tiny_bpe(300))
  target_path = root / "target.gguf"
  held = _write_gguf(target_path, tok_meta)
  cfg0, target, tk, prov = gi.load_gguf(str(target_path))
  cfg = cfg0.replace(mtp=dict(depth=1, draft_vocab_size=SIZE, recursive_steps=2))
  rng = np.random.default_rng(0)
  src = str(root / "source")
  ckpt = ckpt_lib.Checkpointer(src, keep=3)
  models = {}
  for step, seed in ((5, 1), (7, 2)):
    m = params_from_hf_tensors(cfg, held, "held", seed=seed)
    dv.set_draft_vocab(m, np.sort(rng.choice(300, SIZE, replace=False)))
    ckpt.save(step, nnx.state(m, nnx.Param), {}, None, cfg)
    models[step] = m
  ckpt.close()
  with open(os.path.join(src, "metrics.jsonl"), "w") as f:
    for r in (_eval_row(5, 0.3), {"step": 6, "split": "train", "loss": 2.0}, _eval_row(7, 0.55),
              _eval_row(9, 0.9)):
      f.write(json.dumps(r) + "\n")
  with open(os.path.join(src, "import.json"), "w") as f:
    json.dump(prov, f)
  bf16 = export_run.export_modules(src, str(root / "m7.safetensors"), command="test")
  f32 = export_run.export_modules(src, str(root / "m5.safetensors"), step=5, dtype="float32")
  return dict(root=root, tok_meta=tok_meta, gguf=str(target_path), cfg=cfg, cfg0=cfg0,
              target=target, tokenizer=tk, src=src, models=models, bf16=bf16, f32=f32)


@pytest.fixture(scope="module")
def imported(world):
  """The target imported with the bf16 file (step 7) and with the f32 one (step 5)."""
  root = world["root"]
  return {7: gi.import_gguf(world["gguf"], str(root / "wd7"), mtp_modules=world["bf16"]),
          5: gi.import_gguf(world["gguf"], str(root / "wd5"), mtp_modules=world["f32"])}


def test_file_holds_only_the_modules_and_its_metadata(world):
  mf = modules.read_modules_file(world["bf16"])
  src = _flat(world["models"][7])
  want = {".".join(map(str, p)) for p in src if p[0] == "mtp"} | {"draft_vocab"}
  assert set(mf.tensors) == want                      # no embedding, head or backbone
  assert all(a.dtype.name == "bfloat16" for n, a in mf.tensors.items() if n != "draft_vocab")
  assert mf.tensors["draft_vocab"].dtype == np.int32
  assert mf.step == 7 and mf.dtype == "bfloat16" and mf.meta["format_version"] == 1
  assert mf.cfg == world["cfg"]                       # the source's full config
  assert mf.eval_row == _eval_row(7, 0.55)            # the last eval row at or before step 7
  assert mf.provenance["command"] == "test" and mf.provenance["commit"] and mf.provenance["date"]
  assert mf.meta["target"]["format"] == "gguf"
  assert mf.fingerprint == modules.model_fingerprint(world["target"])
  floats = sum(a.size for n, a in mf.tensors.items() if n != "draft_vocab")
  assert os.path.getsize(world["bf16"]) < 2 * floats + 4 * SIZE + 16384
  f32 = modules.read_modules_file(world["f32"])
  assert f32.step == 5 and f32.eval_row == _eval_row(5, 0.3) and f32.provenance["command"] is None


def _module_leaves(model):
  return {p: a for p, a in _flat(model).items() if p[0] == "mtp"}


def test_import_attaches_the_modules_and_draft_vocab(world, imported):
  cfg, model, step = loading.load_model(imported[7])
  assert step == 0 and cfg.mtp == world["cfg"].mtp and cfg.model == world["cfg0"].model
  src = world["models"][7]
  got, want = _module_leaves(model), _module_leaves(src)
  assert set(got) == set(want)
  for p in want:                                       # bf16 rounding of the source, then f32
    np.testing.assert_array_equal(got[p], want[p].astype(jnp.bfloat16).astype(np.float32), str(p))
  assert any(not np.array_equal(got[p], want[p]) for p in want)   # the rounding is visible
  np.testing.assert_array_equal(dv.draft_vocab_ids(model), dv.draft_vocab_ids(src))
  for p, a in _flat(world["target"]).items():          # the backbone is the import's
    np.testing.assert_array_equal(_flat(model)[p], a)
  with open(os.path.join(imported[7], "import.json")) as f:
    entry = json.load(f)
  assert entry["mtp_init"] == "mtp_modules" and entry["mtp_depth"] == 1
  assert entry["mtp_modules"]["fingerprint_matches"] and entry["mtp_modules"]["step"] == 7
  _, m5, _ = loading.load_model(imported[5])           # float32 file: bitwise
  for p, a in _module_leaves(world["models"][5]).items():
    np.testing.assert_array_equal(_module_leaves(m5)[p], a)
  np.testing.assert_array_equal(dv.draft_vocab_ids(m5), dv.draft_vocab_ids(world["models"][5]))


def test_stage_prior_reads_the_carried_row(imported):
  p = calibrate.stage_prior(imported[7], 3)
  assert p["step"] == 0 and p["greedy"] == pytest.approx((0.54,))
  assert p["sampling"] == pytest.approx((0.45,))
  assert calibrate.stage_prior(imported[5], 3)["greedy"] == pytest.approx((0.29,))
  with open(os.path.join(imported[7], "metrics.jsonl")) as f:
    rows = [json.loads(x) for x in f]
  assert len(rows) == 1 and rows[0]["source_step"] == 7 and rows[0]["step"] == 0


def test_greedy_mtp_equals_ar_on_the_imported_workdir(imported):
  cfg, model, _ = loading.load_model(imported[7])
  assert cfg.mtp.depth + cfg.mtp.recursive_steps == 3
  prompts = [np.arange(1, 9, dtype=np.int32) % 300 + 5, np.arange(40, 45, dtype=np.int32)]
  tk = tok.load_tokenizer(imported[7])
  ref = Decoder(model, "ar", tokenizer=tk).generate(prompts, 12, GREEDY)
  gen = Decoder(model, "mtp", 3, tokenizer=tk).generate(prompts, 12, GREEDY)
  for b in range(len(prompts)):
    np.testing.assert_array_equal(gen.tokens[b], ref.tokens[b], err_msg=f"row {b}")


def test_bf16_target_and_hf_target(world, imported, tmp_path):
  """The fingerprint does not depend on the target's param dtype, and a
  Hugging Face directory of the same target takes the same modules."""
  wd = gi.import_gguf(world["gguf"], str(tmp_path / "b"), dtype="bfloat16",
                      mtp_modules=world["f32"])
  cfg, model, _ = loading.load_model(wd)
  assert cfg.model.param_dtype == "bfloat16"
  for p, a in _module_leaves(world["models"][5]).items():
    got = _module_leaves(model)[p]
    assert got.dtype.name == "bfloat16"
    np.testing.assert_array_equal(got, a.astype(jnp.bfloat16))
  hf_dir = export_lib.write_export(world["target"], world["cfg0"], str(tmp_path / "hf"),
                                   tokenizer=world["tokenizer"])
  wd = hi.import_hf_dir(hf_dir, str(tmp_path / "h"), mtp_modules=world["bf16"])
  _, m7, _ = loading.load_model(imported[7])
  _, mh, _ = loading.load_model(wd)
  for p, a in _flat(m7).items():
    np.testing.assert_array_equal(_flat(mh)[p], a, str(p))
  assert calibrate.stage_prior(wd, 1)["greedy"] == pytest.approx((0.54,))


def _one_line(e, path):
  msg = str(e.value)
  assert "\n" not in msg and str(path) in msg, msg
  return msg


def test_another_target_is_refused_unless_allowed(world, tmp_path):
  other = tmp_path / "other.gguf"
  _write_gguf(other, world["tok_meta"], seed=1)          # same shapes, other weights
  with pytest.raises(ModelImportError) as e:
    gi.import_gguf(str(other), str(tmp_path / "wd"), mtp_modules=world["bf16"])
  assert "fingerprint" in _one_line(e, world["bf16"]) and "--allow_other_target" in str(e.value)
  assert not (tmp_path / "wd").exists()
  wd = gi.import_gguf(str(other), str(tmp_path / "wd"), mtp_modules=world["bf16"],
                      allow_other_target=True)
  with open(os.path.join(wd, "import.json")) as f:
    assert json.load(f)["mtp_modules"]["fingerprint_matches"] is False


def test_another_architecture_lists_the_fields(world, tmp_path):
  wide = tmp_path / "wide.gguf"
  _write_gguf(wide, world["tok_meta"], dims=dict(DIMS, d=48, hd=12, ff=96))
  with pytest.raises(ModelImportError) as e:
    gi.import_gguf(str(wide), str(tmp_path / "wd"), mtp_modules=world["bf16"])
  msg = _one_line(e, world["bf16"])
  for field in ("model.d_model: 32 (modules) != 48 (target)", "model.head_dim", "model.mlp_dim"):
    assert field in msg, msg
  assert "model.num_heads" not in msg and not (tmp_path / "wd").exists()


def _safetensors_header(path):
  data = open(path, "rb").read()
  n = struct.unpack("<Q", data[:8])[0]
  return data, n, json.loads(data[8:8 + n])


def _bad_files(world, d):
  """{case: (path, expected text)} of broken modules files in folder ``d``."""
  good = modules.read_modules_file(world["bf16"])
  data, n, header = _safetensors_header(world["bf16"])
  out = {"missing": (str(d / "absent.safetensors"), "no such file")}

  def raw(name, content):
    (d / name).write_bytes(content)
    return str(d / name)
  out["garbage"] = (raw("garbage.safetensors", b"not safetensors" * 20), "not a readable safetensors")
  out["empty"] = (raw("empty.safetensors", b""), "not a readable safetensors")
  out["truncated"] = (raw("trunc.safetensors", data[:-40]), "not a readable safetensors")
  start = 8 + n + header["mtp.0.proj.kernel"]["data_offsets"][0]
  flipped = bytearray(data)
  flipped[start] ^= 1                                     # a low mantissa bit: still finite
  out["flipped byte"] = (raw("flip.safetensors", bytes(flipped)), "CRC-32")
  from safetensors.numpy import save_file
  save_file({"x": np.zeros(3, np.float32)}, str(d / "plain.safetensors"))
  out["no metadata"] = (str(d / "plain.safetensors"), "no 'mtp_modules' metadata")
  save_file({"x": np.zeros(3, np.float32)}, str(d / "notjson.safetensors"),
            metadata={"format": "mtp-modules", "mtp_modules": "{oops"})
  out["not json"] = (str(d / "notjson.safetensors"), "is not JSON")

  def variant(name, tensors=None, **meta_changes):
    meta = {k: v for k, v in good.meta.items() if k != "tensors"}
    meta.update(meta_changes)
    for k in [k for k, v in meta_changes.items() if v is None]:
      del meta[k]
    return modules.write_raw(str(d / name), good.tensors if tensors is None else tensors, meta)
  out["version"] = (variant("v2.safetensors", format_version=2), "format_version=2")
  out["no config"] = (variant("nocfg.safetensors", config=None), "no 'config' field")
  out["bad config"] = (variant("badcfg.safetensors", config={"model": {"d_model": -1}}),
                       "model.d_model")
  t = dict(good.tensors)
  t["mtp.0.proj.kernel"] = t["mtp.0.proj.kernel"][:-1]
  out["shape"] = (variant("shape.safetensors", t), "tensor 'mtp.0.proj.kernel' has shape (63, 32)")
  t = {k: v for k, v in good.tensors.items() if k != "mtp.0.out_norm.scale"}
  out["missing tensor"] = (variant("less.safetensors", t), "no tensor 'mtp.0.out_norm.scale'")
  t = {**good.tensors, "mtp.1.out_norm.scale": good.tensors["mtp.0.out_norm.scale"]}
  out["extra tensor"] = (variant("more.safetensors", t), "tensor 'mtp.1.out_norm.scale' has no place")
  t = {**good.tensors, "draft_vocab": good.tensors["draft_vocab"][::-1].copy()}
  out["draft vocab"] = (variant("vocab.safetensors", t), "sorted ascending")
  return out


FILE_LEVEL = ("missing", "garbage", "empty", "truncated", "flipped byte", "no metadata",
              "not json", "version", "no config", "bad config")


def test_every_bad_file_is_one_line_and_nothing_is_written(world, tmp_path):
  for case, (path, needle) in _bad_files(world, tmp_path).items():
    wd = tmp_path / f"wd-{case.replace(' ', '_')}"
    with pytest.raises(ModelImportError) as e:
      gi.import_gguf(world["gguf"], str(wd), mtp_modules=path)
    assert needle in _one_line(e, path), (case, str(e.value))
    assert not wd.exists(), case
    if case in FILE_LEVEL:                                # the library reader alone
      with pytest.raises(modules.ModulesFileError, match="^" + str(path)):
        modules.read_modules_file(path)
  assert not [p for p in os.listdir(tmp_path) if p.startswith(".wd")]


def test_import_cli(world, tmp_path, capsys):
  wd = tmp_path / "wd"
  assert cli.main(["--gguf", world["gguf"], "--workdir", str(wd), "--mtp_modules", world["bf16"],
                   "--dtype", "bfloat16"]) == 0
  assert "with the MTP modules of" in capsys.readouterr().out
  assert loading.load_config(str(wd))[0].mtp.draft_vocab_size == SIZE
  for extra, needle in ((["--mtp_depth", "1"], "excludes --mtp_depth"),
                        (["--mtp_init", "last_block"], "excludes --mtp_init"),
                        (["--seed", "3"], "excludes --seed")):
    assert cli.main(["--gguf", world["gguf"], "--workdir", str(tmp_path / "x"), "--mtp_modules",
                     world["bf16"], *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err, err
  bad = tmp_path / "bad.safetensors"
  bad.write_bytes(b"\x00" * 64)
  for args, needle in ((["--mtp_modules", str(bad)], str(bad)),
                       (["--allow_other_target"], "needs --mtp_modules")):
    assert cli.main(["--gguf", world["gguf"], "--workdir", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err, err
  assert not (tmp_path / "x").exists()
  with pytest.raises(ModelImportError, match="excludes --mtp_depth"):   # library too
    gi.load_gguf(world["gguf"], mtp_depth=1, mtp_modules=world["bf16"])


def test_writer_rules(world, tmp_path):
  with pytest.raises(modules.ModulesFileError, match="mtp.depth=0"):
    modules.write_modules_file(world["target"], world["cfg0"], str(tmp_path / "a.safetensors"),
                               step=0)
  out = tmp_path / "m.safetensors"
  with pytest.raises(modules.ModulesFileError, match="must be one of"):
    export_run.export_modules(world["src"], str(out), dtype="float16")
  with pytest.raises(modules.ModulesFileError, match="does not exist"):
    export_run.export_modules(world["src"], str(tmp_path / "no" / "m.safetensors"))
  with pytest.raises(ckpt_lib.CheckpointError, match="step 6 not found"):
    export_run.export_modules(world["src"], str(out), step=6)
  assert not out.exists()
  (tmp_path / "other.bin").write_bytes(b"keep me")
  for overwrite, needle in ((False, "--overwrite"), (True, "not an MTP modules file")):
    with pytest.raises(modules.ModulesFileError, match=needle):
      export_run.export_modules(world["src"], str(tmp_path / "other.bin"), overwrite=overwrite)
  assert (tmp_path / "other.bin").read_bytes() == b"keep me"
  export_run.export_modules(world["src"], str(out), step=5)
  export_run.export_modules(world["src"], str(out), overwrite=True)   # a modules file: replaced
  assert modules.read_modules_file(str(out)).step == 7
  assert sorted(os.listdir(tmp_path)) == ["m.safetensors", "other.bin"]   # no temporary left


def test_fingerprint_sees_one_backbone_value_not_the_param_dtype(world):
  flat = _flat(world["target"])
  fp = modules.backbone_fingerprint(flat)
  as_bf16 = {p: a.astype(jnp.bfloat16) for p, a in flat.items()}
  assert modules.backbone_fingerprint(as_bf16) == fp
  changed = dict(flat)
  e = flat[("blocks", 1, "mlp", "down", "kernel")].copy()
  e[3, 4] += 0.05
  changed[("blocks", 1, "mlp", "down", "kernel")] = e
  assert modules.backbone_fingerprint(changed) != fp
  with_modules = {**flat, ("mtp", 0, "proj", "kernel"): np.ones((64, 32), np.float32)}
  assert modules.backbone_fingerprint(with_modules) == fp    # modules are not the target


@pytest.mark.cpu_only
def test_export_cli(world, tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  run = lambda *a: subprocess.run([sys.executable, "-m", "mtp.export", *a], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=300)
  out = tmp_path / "m.safetensors"
  r = run("--workdir", world["src"], "--modules_out", str(out), "--modules_dtype", "float32",
          "--step", "5")
  assert r.returncode == 0 and f"wrote {out}" in r.stdout, r.stderr[-2000:]
  mf = modules.read_modules_file(str(out))
  assert mf.step == 5 and mf.dtype == "float32" and "--modules_out" in mf.provenance["command"]
  r = run("--workdir", world["src"], "--modules_out", str(out), "--out", str(tmp_path / "hf"))
  assert r.returncode == 2 and "exactly one of --out" in r.stderr, r.stderr[-2000:]
  assert len(r.stderr.strip().splitlines()) == 1
