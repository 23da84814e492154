"""Third-party noise is dropped at its logger; meaningful messages still show."""

import logging

from absl import logging as absl_logging

from mtp import checkpoint as ckpt_lib
from mtp import data as data_lib
from mtp import quiet


def _absl_messages(caplog):
  return [r.getMessage() for r in caplog.records if r.name == "absl"]


def test_filter_drops_only_the_named_messages(caplog):
  caplog.set_level(logging.WARNING)
  with quiet.absl_messages_dropped("Given directory is read only"):
    absl_logging.warning("Given directory is read only=%s", "/x")
    absl_logging.warning("something that matters: %s", "disk full")
  absl_logging.warning("Given directory is read only=%s", "/y")     # outside the block
  assert _absl_messages(caplog) == ["something that matters: disk full",
                                    "Given directory is read only=/y"]


def test_read_only_checkpoint_opens_silently(markov_workdir, caplog):
  caplog.set_level(logging.WARNING)
  ckpt_lib.Checkpointer(markov_workdir, read_only=True).close()
  assert _absl_messages(caplog) == [], caplog.text


def _check_one_build_line(capsys, caplog, name: str, *words: str):
  out, err = capsys.readouterr()
  assert "Downloading and preparing" not in out + err and "downloaded and prepared" not in out + err
  built = [l for l in err.splitlines() if l.startswith(f"building dataset {name} from")]
  assert len(built) == 1 and all(w in built[0] for w in words), err
  assert not [m for m in _absl_messages(caplog) if "Variant folder" in m], caplog.text


def test_building_a_dataset_says_one_line_of_its_own(tmp_path, caplog, capsys):
  caplog.set_level(logging.WARNING)
  data_lib.prepare_embedded("python_docs", str(tmp_path))
  _check_one_build_line(capsys, caplog, "python_docs", str(tmp_path), "pydoc_data")
  data_lib.prepare_embedded("python_docs", str(tmp_path))           # built: says nothing
  assert capsys.readouterr() == ("", "")
  for i in range(2):
    (tmp_path / f"doc{i}.txt").write_text(f"document {i}\n")
  data_lib.prepare_text_files(str(tmp_path / "*.txt"), str(tmp_path / "tfds"))
  _check_one_build_line(capsys, caplog, "text_files", "2 local files", str(tmp_path / "tfds"))
