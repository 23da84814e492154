import pytest

from mtp import config as config_lib
from mtp.config import ConfigError
from tests.conftest import tiny_config


@pytest.mark.parametrize("override, field", [
    (dict(mtp=dict(depth=-1)), "mtp.depth"),
    (dict(model=dict(d_model=0)), "model.d_model"),
    (dict(model=dict(num_kv_heads=3)), "model.num_kv_heads"),
    (dict(train=dict(batch_size=0)), "train.batch_size"),
    (dict(train=dict(seq_len=10_000)), "train.seq_len"),
    (dict(model=dict(vocab_size=100)), "model.vocab_size"),
    (dict(mtp=dict(loss_weight=-0.1)), "mtp.loss_weight"),
    (dict(model=dict(bogus=1)), "model.bogus"),
    (dict(model=dict(d_model="big")), "model.d_model"),
    (dict(mesh=dict(data=0)), "mesh.data"),
    (dict(data=dict(num_workers=65)), "data.num_workers"),
    (dict(data=dict(num_workers=-1)), "data.num_workers"),
    (dict(model=dict(num_layers=1025)), "model.num_layers"),
])
def test_bad_values_name_the_field(override, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    tiny_config(**override)


def test_unknown_section():
  with pytest.raises(ConfigError, match="unknown config key"):
    config_lib.from_dict({"modle": {}})


def test_config_files_load_and_keep_tooling_names():
  import importlib.util
  for name in ("tiny", "small"):
    spec = importlib.util.spec_from_file_location(name, f"configs/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cd = mod.get_config()
    cfg = config_lib.from_dict(cd)
    for dotted in ("mtp.depth", "mtp.loss_weight", "train.num_steps", "train.batch_size",
                   "train.seq_len", "train.seed", "data.name", "checkpoint.every_steps",
                   "model.num_layers", "model.d_model"):
      sec, f = dotted.split(".")
      assert hasattr(getattr(cfg, sec), f)
      assert f in cd[sec]


def test_architecture_mismatch_lists_fields():
  a, b = tiny_config(), tiny_config(mtp=dict(depth=1), model=dict(d_model=48))
  diffs = config_lib.architecture_mismatches(a, b)
  assert any("mtp.depth" in d for d in diffs) and any("model.d_model" in d for d in diffs)
  assert config_lib.architecture_mismatches(a, tiny_config(train=dict(num_steps=99))) == []


def test_json_roundtrip():
  import json
  cfg = tiny_config()
  assert config_lib.from_dict(json.loads(cfg.to_json())) == cfg


def test_non_finite_floats_rejected():
  with pytest.raises(ConfigError, match="train.learning_rate must be a finite number"):
    tiny_config(train=dict(learning_rate=float("inf")))


def test_override_keys_checked_before_parsing():
  config_lib.check_override_keys(["--config.train.learning_rate=1", "--workdir=x"])
  with pytest.raises(ConfigError, match=r"unknown config key 'train\.lr' in train; allowed: .*learning_rate"):
    config_lib.check_override_keys(["--config.train.lr=3"])
  with pytest.raises(ConfigError, match="unknown config key 'foo'"):
    config_lib.check_override_keys(["--config.foo.bar=3"])
  with pytest.raises(ConfigError, match="not a section"):
    config_lib.check_override_keys(["--config.train.seed.x=3"])


def test_load_config_file(tmp_path):
  assert config_lib.load_config_file("configs/tiny.py").mtp.depth == 2
  with pytest.raises(ConfigError, match="does not exist"):
    config_lib.load_config_file(str(tmp_path / "nope.py"))
  bad = tmp_path / "bad.py"
  bad.write_text("x = 1\n")
  with pytest.raises(ConfigError, match="get_config"):
    config_lib.load_config_file(str(bad))


def test_config_file_errors_name_the_path(tmp_path):
  cases = {"syntax.py": ("def get_config(:\n", r"syntax\.py' cannot be loaded: SyntaxError \(line 1\)"),
           "raises.py": ("import nonexistent_module_xyz\n", "cannot be loaded: ModuleNotFoundError"),
           "none.py": ("def get_config():\n  pass\n", "returned None"),
           "boom.py": ("def get_config():\n  raise ValueError('boom')\n",
                       r"failed in get_config\(\): ValueError: boom")}
  for name, (text, msg) in cases.items():
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=msg):
      config_lib.load_config_file(str(tmp_path / name))
  assert config_lib.read_config_file("configs/tiny.py").mtp.depth == 2


def test_config_file_arg():
  assert config_lib.config_file_arg(["--config", "a.py", "--workdir", "w"]) == "a.py"
  assert config_lib.config_file_arg(["-config=b.py:x", "--config.mtp.depth=1"]) == "b.py:x"
  assert config_lib.config_file_arg(["--workdir", "w", "--configs=x"]) is None
  assert config_lib.config_file_arg(["--", "--config=c.py"]) is None


def test_smollm_stage_config_trains_three_offsets_whatever_the_depth(tmp_path):
  """configs/smollm_mtp.py reads D from the imported workdir and recurses
  module D for 3 - D more steps (D = 1: 2, D = 2: 1, D = 3: 0)."""
  import importlib.util
  from tests import tiny_bpe
  spec = importlib.util.spec_from_file_location("smollm_mtp", "configs/smollm_mtp.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  for d, r in ((1, 2), (2, 1), (3, 0)):
    (tmp_path / f"d{d}").mkdir()
    wd = tiny_bpe.import_tiny_workdir(str(tmp_path / f"d{d}"), mtp_depth=d)
    cd = mod.get_config(wd)
    cd.mtp.draft_vocab_size = 64                  # 4,096 is for SmolLM2's 49k ids, not 320
    cfg = config_lib.from_dict(cd)
    assert (cfg.mtp.depth, cfg.mtp.recursive_steps) == (d, r)
    assert cfg.train.init_from == wd and cfg.train.freeze_backbone
