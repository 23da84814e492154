"""data.files and symbolic links: ``**`` never enters a symlinked folder, so a
link back into the tree can neither repeat files nor make the walk loop; a
file reached by several paths, or repeated byte for byte, is one document, so
no validation document is also a training document."""

import contextlib
import os
import signal

from mtp import data
from mtp.config import DataConfig

# Distinct contents, so a document seen on both sides of the split is a copy.
FILES = {**{f"pkg/mod{i}.py": f"def f{i}():\n  return {i}\n" for i in range(6)},
         "pkg/sub/deep.py": "deep = 1\n", "top.py": "import pkg\n"}


def _tree(root) -> None:
  for name, text in FILES.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text, encoding="utf-8")


class Overran(Exception):
  """Not an OSError: glob swallows those, so a TimeoutError would be lost."""


@contextlib.contextmanager
def _deadline(seconds: float):
  """Raises ``Overran`` inside the body once it has run ``seconds`` (and
  every second after, in case one is swallowed), so a walk that loops fails
  the test instead of hanging the suite."""
  def expire(signum, frame):
    raise Overran(f"still running after {seconds} s")
  old = signal.signal(signal.SIGALRM, expire)
  signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
  try:
    yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def _names(files: str) -> list[str]:
  return [f.name for f in data.match_text_files(files)]


def _docs(files: str, data_dir) -> dict[str, list[tuple[str, str]]]:
  """{split: [(name, text)]} of the text_files dataset built from ``files``."""
  cfg = DataConfig(name="text_files", files=files, data_dir=str(data_dir))
  out = {}
  for split in ("train", "validation"):
    src = data.load_source(cfg, split)
    out[split] = [(src[i]["name"].decode(), src[i]["text"].decode()) for i in range(len(src))]
  return out


def _assert_each_text_once(docs) -> None:
  texts = [t for split in docs.values() for _, t in split]
  assert len(texts) == len(set(texts)), sorted(texts)
  assert docs["train"] and docs["validation"]
  assert not {t for _, t in docs["train"]} & {t for _, t in docs["validation"]}


def test_a_link_to_its_own_folder_gives_each_file_once(tmp_path):
  proj = tmp_path / "proj"
  _tree(proj)
  os.symlink(".", proj / "self")
  assert _names(f"{proj}/**/*.py") == sorted(FILES)
  docs = _docs(f"{proj}/**/*.py", tmp_path / "d")
  assert sorted(n for split in docs.values() for n, _ in split) == sorted(FILES)
  _assert_each_text_once(docs)


def test_a_link_to_the_parent_folder_neither_loops_nor_repeats(tmp_path):
  proj = tmp_path / "proj"
  _tree(proj)
  os.symlink(".", proj / "self")
  os.symlink("..", proj / "pkg" / "up")   # with self: 2^40 paths for glob to walk
  with _deadline(30):
    assert _names(f"{proj}/**/*.py") == sorted(FILES)
    assert _names(f"{proj}/pkg/**/*.py") == sorted(n[4:] for n in FILES if n.startswith("pkg/"))
  _assert_each_text_once(_docs(f"{proj}/**/*.py", tmp_path / "d"))


def test_a_symlinked_file_is_read_once_under_the_name_of_its_real_path(tmp_path):
  proj, outside = tmp_path / "proj", tmp_path / "outside"
  proj.mkdir()
  outside.mkdir()
  (proj / "real.py").write_text("real = 1\n")
  (proj / "other.py").write_text("other = 1\n")
  (outside / "ext.py").write_text("ext = 1\n")
  os.symlink("real.py", proj / "alias.py")              # sorts first, yet real.py names it
  os.symlink(outside / "ext.py", proj / "ext.py")       # its target is matched by no pattern
  matched = data.match_text_files(f"{proj}/*.py")
  assert [f.name for f in matched] == ["ext.py", "other.py", "real.py"]
  assert matched[0].path == os.path.realpath(outside / "ext.py")
  assert _names(f"{proj}/alias.py") == ["alias.py"]     # a link alone is read through
  assert _names(f"{proj}/alias.py,{proj}/real.py") == ["real.py"]
  docs = _docs(f"{proj}/*.py", tmp_path / "d")
  assert sorted(n for split in docs.values() for n, _ in split) == ["ext.py", "other.py",
                                                                     "real.py"]
  _assert_each_text_once(docs)


def test_a_symlinked_outside_folder_is_read_only_where_a_pattern_names_it(tmp_path):
  proj, lib = tmp_path / "proj", tmp_path / "lib"
  _tree(proj)
  (lib / "inner").mkdir(parents=True)
  (lib / "util.py").write_text("util = 1\n")
  (lib / "inner" / "core.py").write_text("core = 1\n")
  os.symlink(lib, proj / "vendor")
  # '**' does not enter it ...
  assert _names(f"{proj}/**/*.py") == sorted(FILES)
  assert not [n for n in _names(f"{proj}/**") if n.startswith("vendor/")]
  # ... a pattern that spells it, or reaches it with '*', does.
  assert sorted(_names(f"{proj}/**/*.py,{proj}/vendor/**/*.py")) == sorted(
      [*FILES, "inner/core.py", "util.py"])
  assert sorted(_names(f"{proj}/*/*.py")) == sorted(
      [n for n in FILES if n.count("/") == 1] + ["vendor/util.py"])


def test_hard_links_and_identical_copies_are_one_document(tmp_path, caplog):
  proj = tmp_path / "proj"
  _tree(proj)
  os.link(proj / "top.py", proj / "z_hard.py")                 # sorts after top.py
  (proj / "pkg" / "z_copy.py").write_text(FILES["pkg/mod3.py"])
  assert _names(f"{proj}/**/*.py") == sorted([*FILES, "pkg/z_copy.py"])
  with caplog.at_level("WARNING"):
    docs = _docs(f"{proj}/**/*.py", tmp_path / "d")
  assert sorted(n for split in docs.values() for n, _ in split) == sorted(FILES)
  _assert_each_text_once(docs)
  assert "skipped 1 files identical to an earlier one: 'pkg/z_copy.py' (same as 'pkg/mod3.py')" \
      in caplog.text
