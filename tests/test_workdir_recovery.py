"""A training workdir damaged between runs still resumes, or stops with one
clear line: a torn metrics.jsonl row (a full disk) is dropped with a notice,
a metrics append that fails partway leaves no torn line, a config.json that
is not JSON stops the resume before anything is written, and a hand-edited
config.json is not taken for the config the checkpoint was trained with."""

import errno
import io
import json
import os
import shutil

import pytest

from mtp.config import ConfigError
from tests.conftest import tiny_config
from train import workdir as workdir_lib
from train.loop import MetricWriter, train


def _cfg(data_dir, **train_fields):
  return tiny_config(data=dict(data_dir=data_dir), train=train_fields)


def _row(step, split, loss=1.0):
  return json.dumps({"step": step, "split": split, "loss": loss}) + "\n"


CLEAN = _row(1, "train") + _row(2, "train") + _row(2, "eval", 0.5)


def _write(path, data: bytes | str):
  with open(path, "wb") as f:
    f.write(data.encode() if isinstance(data, str) else data)


def _files(workdir):
  """{relative path: bytes} of every file under ``workdir`` but the lock
  (whose holder metadata every run rewrites)."""
  out = {}
  for root, _, names in os.walk(workdir):
    for name in names:
      p = os.path.join(root, name)
      if name != workdir_lib.LOCK_FILE:
        out[os.path.relpath(p, workdir)] = open(p, "rb").read()
  return out


# -- metrics.jsonl ---------------------------------------------------------------------------

def test_torn_last_line_is_dropped_on_resume_as_if_never_written(tmp_path, capsys):
  clean, torn = tmp_path / "clean", tmp_path / "torn"
  clean.mkdir(), torn.mkdir()
  _write(clean / "metrics.jsonl", CLEAN)
  _write(torn / "metrics.jsonl", CLEAN + _row(3, "train")[:17])     # the disk filled up here
  due = lambda step: True
  want = workdir_lib.resume_metrics(str(clean), 2, due)
  assert workdir_lib.resume_metrics(str(torn), 2, due) == want
  assert (torn / "metrics.jsonl").read_text() == CLEAN
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and str(torn / "metrics.jsonl") in err[0] and "dropped line 4" in err[0]


def test_any_line_without_a_row_is_dropped_and_a_whole_last_row_kept(tmp_path, capsys):
  path = str(tmp_path / "metrics.jsonl")
  _write(path, _row(1, "train").encode() + b'{"step": 2, "spl\xff\xfe\n' + b"[1, 2]\n"
         + b'{"step": "3", "split": "train"}\n' + b"\n" + _row(4, "eval").encode()
         + _row(5, "train").rstrip("\n").encode())                   # complete, newline lost
  assert [r["step"] for r in workdir_lib.metric_rows(path)] == [1, 4, 5]
  assert "skipped lines 2, 3, 4" in capsys.readouterr().err
  workdir_lib.truncate_metrics(path, 4)
  assert open(path).read() == _row(1, "train") + _row(4, "eval")
  assert "dropped lines 2, 3, 4" in capsys.readouterr().err
  _write(path, CLEAN + "\0" * 40)                                     # a zero-filled tail
  workdir_lib.truncate_metrics(path, 9)
  assert open(path).read() == CLEAN


class _DiskFills(io.FileIO):
  """A file whose next write stores half its bytes, then fails as on a full
  disk (the way a partial write ends: the first call returns short, the
  next raises ENOSPC)."""
  full = False

  def write(self, data):
    if self.full:
      raise OSError(errno.ENOSPC, "No space left on device")
    self.full = True
    return super().write(bytes(data)[:len(data) // 2])


def test_a_failed_append_leaves_no_torn_line(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  _write(path, CLEAN)
  with _DiskFills(path, "ab") as f:
    with pytest.raises(OSError, match="No space"):
      workdir_lib.append_line(f, _row(3, "train"))
  assert open(path).read() == CLEAN
  with open(path, "ab", buffering=0) as f:                            # space freed
    workdir_lib.append_line(f, _row(3, "train"))
  assert open(path).read() == CLEAN + _row(3, "train")


def test_metric_writer_never_glues_a_row_onto_a_torn_one(tmp_path, capsys):
  path = tmp_path / "metrics.jsonl"
  for tail, kept in ((_row(3, "train")[:20], ""),                   # torn: cut off
                     (_row(3, "train").rstrip("\n"), _row(3, "train"))):   # whole: completed
    _write(path, CLEAN + tail)
    writer = MetricWriter(str(tmp_path), True)
    writer.write(4, "train", {"loss": 1.0})
    writer.close()
    assert path.read_text() == CLEAN + kept + _row(4, "train")
  assert "dropped line 4" in capsys.readouterr().err


# -- config.json -----------------------------------------------------------------------------

@pytest.mark.parametrize("text", ['{"model": {"d_model": 32', "[1, 2]", ""])
def test_damaged_config_json_is_one_line_and_nothing_is_touched(tmp_path, text):
  _write(tmp_path / "config.json", text)
  before = _files(tmp_path)
  with pytest.raises(ConfigError) as e:
    workdir_lib.record_config(str(tmp_path), tiny_config(), 3, tiny_config())
  msg = str(e.value)
  assert "\n" not in msg and str(tmp_path / "config.json") in msg and "delete it" in msg
  assert _files(tmp_path) == before


def test_edited_config_json_is_not_taken_for_the_trained_config(tmp_path):
  trained = tiny_config()
  edited = json.loads(trained.to_json())
  edited["train"]["learning_rate"] = 0.5
  _write(tmp_path / "config.json", json.dumps(edited))
  # the same config as the checkpoint: no change, only the edit is reported
  note = workdir_lib.record_config(str(tmp_path), trained, 3, trained)
  assert "config.json differs from the config checkpoint 3 was saved with" in note
  assert "train.learning_rate: 0.01 -> 0.5" in note and "config changed" not in note
  assert (tmp_path / "config.json").read_text() == trained.to_json()
  assert not (tmp_path / "config.until_step3.json").exists()
  # a real change: described against the checkpoint's config, which is the one kept
  _write(tmp_path / "config.json", json.dumps(edited))
  longer = tiny_config(train=dict(num_steps=9))
  note = workdir_lib.record_config(str(tmp_path), longer, 3, trained)
  assert "config changed since the last run (train.num_steps: 6 -> 9)" in note
  assert json.loads((tmp_path / "config.until_step3.json").read_text()) == json.loads(
      trained.to_json())


def test_config_json_is_the_reference_only_without_a_checkpoint_record(tmp_path):
  old = json.loads(tiny_config().to_json())
  del old["train"]["min_lr_ratio"]                  # written before a field existed: same config
  _write(tmp_path / "config.json", json.dumps(old))
  assert workdir_lib.record_config(str(tmp_path), tiny_config(), 3, tiny_config()) == ""
  assert workdir_lib.record_config(str(tmp_path), tiny_config(), 3) == ""
  note = workdir_lib.record_config(str(tmp_path), tiny_config(train=dict(num_steps=9)), 3)
  assert "config changed since the last run (train.num_steps: 6 -> 9)" in note
  assert "differs from the config checkpoint" not in note


# -- through a real resume -------------------------------------------------------------------

@pytest.fixture(scope="module")
def stopped(tmp_path_factory, data_dir):
  """A workdir stopped after checkpoint 3 of 6 (rows: train 2, train 3)."""
  workdir = str(tmp_path_factory.mktemp("stopped") / "run")
  train(_cfg(data_dir), workdir, stop_after=3)
  return workdir


def _copy(stopped, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(stopped, workdir)
  return workdir


def test_run_whose_last_metrics_row_was_torn_resumes_and_finishes(stopped, tmp_path, data_dir,
                                                                  capsys):
  workdir = _copy(stopped, tmp_path)
  path = os.path.join(workdir, "metrics.jsonl")
  first, last = open(path).read().splitlines(keepends=True)
  _write(path, first + last[:len(last) // 2])                         # the disk filled up here
  result = train(_cfg(data_dir), workdir)
  assert result.step == 6 and result.eval
  assert f"{path}: dropped line 2" in capsys.readouterr().err
  lines = open(path).read().splitlines(keepends=True)
  assert lines[0] == first
  assert [(r["step"], r["split"]) for r in map(json.loads, lines)] == [
      (2, "train"), (4, "train"), (4, "eval"), (6, "train"), (6, "eval")]


def test_resume_with_a_damaged_config_json_stops_before_writing(stopped, tmp_path, data_dir):
  workdir = _copy(stopped, tmp_path)
  _write(os.path.join(workdir, "config.json"), '{"model": {"d_mod')
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:        # a resume would drop it
    f.write(_row(5, "train"))
  before = _files(workdir)
  with pytest.raises(ConfigError, match=r"config\.json is not valid JSON .*: fix it, or delete"):
    train(_cfg(data_dir), workdir)
  assert _files(workdir) == before


def test_resume_compares_with_the_checkpoint_config_not_an_edited_file(stopped, tmp_path,
                                                                       data_dir):
  workdir = _copy(stopped, tmp_path)
  path = os.path.join(workdir, "config.json")
  edited = json.load(open(path))
  edited["train"]["learning_rate"] = 0.5                              # by hand, after the run
  _write(path, json.dumps(edited))
  lines = []
  cfg = _cfg(data_dir, num_steps=9)
  train(cfg, workdir, stop_after=3, log=lines.append)                 # resumes, steps nothing
  resumed = [l for l in lines if l.startswith("resumed from")]
  assert len(resumed) == 1
  assert "differs from the config checkpoint 3 was saved with" in resumed[0]
  assert "train.learning_rate: 0.01 -> 0.5" in resumed[0]
  assert "config changed since the last run (train.num_steps: 6 -> 9)" in resumed[0]
  kept = json.load(open(os.path.join(workdir, "config.until_step3.json")))
  assert kept["train"]["learning_rate"] == 0.01 and kept["train"]["num_steps"] == 6
  assert open(path).read() == cfg.to_json()
