"""mtp.data: embedded TFDS corpora, local TFDS datasets, packing, sharding,
checkpointable iterators, and clear errors (never a download)."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds

from mtp import data
from mtp.data import pipeline, sources
from mtp import tokenizer as tok
from mtp.config import DataConfig

PAD, BOS, EOS = tok.PAD_ID, tok.BOS_ID, tok.EOS_ID
TINY = "mtp_tiny_test_corpus"
TINY_TRAIN = 20


def _tiny_text(i: int) -> str:
  # Unicode and a newline in every document; lengths vary around seq_len.
  return f"doc {i:02d} ünïcødé 🚀\n" + "xy" * (i * 3)


class MtpTinyTestCorpus(tfds.core.GeneratorBasedBuilder):
  """A local custom dataset: text under 'content', an int 'label', splits
  train/test (no 'validation')."""

  VERSION = tfds.core.Version("1.0.0")

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls):  # see mtp.mtp.data.corpora._EmbeddedCorpus.code_path
    return None

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
        {"content": tfds.features.Text(), "label": tfds.features.Scalar(np.int64)}))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(range(TINY_TRAIN)),
            "test": self._generate_examples(range(100, 104))}

  def _generate_examples(self, ids):
    for i in ids:
      yield i, {"content": _tiny_text(i), "label": i}


def _stream_tokens(batches) -> np.ndarray:
  """Flattens consecutive batches (rows in stream order) to one token stream."""
  return np.concatenate([b["tokens"].reshape(-1) for b in batches])


def _documents_in_stream(tokens: np.ndarray) -> list[bytes]:
  """Complete [BOS] doc [EOS] pieces of a token stream, as bytes."""
  out, cur = [], None
  for t in tokens.tolist():
    if t == BOS:
      cur = []
    elif t == EOS:
      if cur is not None:
        out.append(bytes(cur))
      cur = None
    elif cur is not None and t < 256:
      cur.append(t)
  return out


def _segments(row_tokens, row_seg):
  return [(s, row_tokens[row_seg == s]) for s in np.unique(row_seg) if s != 0]


@pytest.fixture(scope="module")
def stdlib_cfg(data_dir):
  return DataConfig(name="python_stdlib", data_dir=data_dir)


@pytest.fixture(scope="module")
def docs_cfg(data_dir):
  return DataConfig(name="python_docs", data_dir=data_dir)


@pytest.fixture(scope="module")
def docs_train(docs_cfg):
  return data.load_documents(docs_cfg, "train")


@pytest.fixture(scope="module")
def tiny_cfg(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("tiny_tfds"))
  MtpTinyTestCorpus(data_dir=d, file_format="array_record").download_and_prepare(
      download_dir=os.path.join(d, "dl"),
      download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return DataConfig(name=TINY, text_feature="content", data_dir=d, eval_split="test")


@pytest.fixture
def no_network(monkeypatch):
  """Any attempt to open a network connection fails the test."""
  def refuse(*args, **kwargs):
    raise AssertionError("network access attempted")
  monkeypatch.setattr(socket.socket, "connect", refuse)
  monkeypatch.setattr(socket, "create_connection", refuse)


# --------------------------------------------------------------------------
# Embedded corpora and splits
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", data.EMBEDDED_DATASETS)
def test_embedded_corpora_build_and_split(data_dir, name, no_network):
  cfg = DataConfig(name=name, data_dir=data_dir)
  names = {}
  for split in ("train", "validation"):
    src = data.load_source(cfg, split)
    assert len(src) > 0
    names[split] = {src[i]["name"].decode() for i in range(len(src))}
    assert all(data.split_for_name(name, n) == split for n in names[split])
    texts = data.load_documents(cfg, split, limit=3)
    assert len(texts) == 3 and all(isinstance(t, str) and t.strip() for t in texts)
  assert not names["train"] & names["validation"]
  assert len(names["validation"]) < len(names["train"])
  # One config per interpreter: files live under a per-Python-version folder.
  assert os.path.isdir(os.path.join(data_dir, name, data.interpreter_tag()))
  if name == "python_stdlib":
    assert "os.py" in names["train"] | names["validation"]
    assert not any(n.startswith(("test/", "site-packages/")) for n in names["train"])
  else:
    from pydoc_data.topics import topics
    assert names["train"] | names["validation"] == {k for k, v in topics.items() if v.strip()}


def test_split_is_stable_and_build_is_race_safe(data_dir, docs_cfg, tmp_path):
  assert data.split_for_name("python_stdlib", "os.py") == data.split_for_name("python_stdlib",
                                                                              "os.py")
  # Two processes build the same corpus into a fresh dir at the same time.
  fresh = str(tmp_path / "race")
  code = ("import sys; from mtp import data; from mtp.config import DataConfig; "
          "print(len(data.load_source(DataConfig(name='python_docs', data_dir=sys.argv[1]), "
          "'validation')))")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(data.__file__))))
  env = {**os.environ, "PYTHONPATH": root}
  procs = [subprocess.Popen([sys.executable, "-c", code, fresh], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for _ in range(2)]
  outs = [p.communicate(timeout=120) for p in procs]
  assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
  again = DataConfig(name="python_docs", data_dir=fresh)
  for split in ("train", "validation"):
    a, b = data.load_source(docs_cfg, split), data.load_source(again, split)
    assert [a[i]["name"] for i in range(len(a))] == [b[i]["name"] for i in range(len(b))]
  assert not [f for f in os.listdir(os.path.join(fresh, "python_docs", data.interpreter_tag()))
              if "incomplete" in f]


def test_a_builder_made_before_another_process_built_the_dataset_is_made_again(
    monkeypatch, tmp_path):
  # The race CI hit once: process B makes its builder (no dataset yet, so it
  # reads no splits), process A finishes the build, then B's "is it prepared?"
  # says yes. B must not return the builder that knows no splits.
  from mtp.data import corpora
  real, built = corpora._is_prepared, []
  def is_prepared_after_another_build(builder):
    if not built:
      built.append(True)
      corpora.prepare_embedded("python_docs", str(tmp_path))   # "process A"
    return real(builder)
  monkeypatch.setattr(corpora, "_is_prepared", is_prepared_after_another_build)
  src = data.load_source(DataConfig(name="python_docs", data_dir=str(tmp_path)), "validation")
  assert built and len(src) > 0


def test_resolve_data_dir(monkeypatch, tmp_path):
  monkeypatch.delenv(data.DATA_DIR_ENV, raising=False)
  assert data.resolve_data_dir(DataConfig()) == os.path.expanduser(
      "~/.cache/mtp/tensorflow_datasets")
  monkeypatch.setenv(data.DATA_DIR_ENV, str(tmp_path / "env"))
  assert data.resolve_data_dir(DataConfig()) == str(tmp_path / "env")
  assert data.resolve_data_dir(DataConfig(data_dir=str(tmp_path / "cfg"))) == str(tmp_path / "cfg")


# --------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------


def test_train_rows_are_packed_correctly(docs_cfg, docs_train):
  seq_len, bs = 64, 8
  it = iter(data.make_train_dataset(docs_cfg, seq_len=seq_len, batch_size=bs, seed=3))
  batches = [next(it) for _ in range(40)]
  corpus = [d.encode() for d in docs_train]
  for b in batches:
    assert set(b) == {"tokens", "segment_ids", "positions"}
    for v in b.values():
      assert v.shape == (bs, seq_len) and v.dtype == np.int32
    for toks, seg, pos in zip(b["tokens"], b["segment_ids"], b["positions"]):
      assert seg[0] == 1 and np.all(np.diff(seg) >= 0) and np.all(seg > 0)  # full rows
      assert np.all(toks != PAD)
      pieces = _segments(toks, seg)
      assert [s for s, _ in pieces] == list(range(1, len(pieces) + 1))
      for s, piece in pieces:
        assert np.array_equal(pos[seg == s], np.arange(len(piece)))   # restart at 0
        assert np.all(piece[1:] != BOS)                   # BOS only at a segment start
        assert np.all(piece[:-1] != EOS)                  # EOS only at a segment end
        if s > 1:
          assert piece[0] == BOS                          # a new document starts here
        if s < len(pieces):
          assert piece[-1] == EOS                         # ... right after the previous EOS
        body = bytes(int(t) for t in piece if t < 256)
        assert any(body in doc for doc in corpus)         # decodes to corpus text
  # Concatenated rows are whole documents back to back: long ones are split
  # across rows, never truncated.
  stream = _stream_tokens(batches)
  docs = _documents_in_stream(stream)
  assert len(docs) >= 2 and all(d in set(corpus) for d in docs)
  assert max(len(d) for d in docs) > seq_len


def test_eval_batches_deterministic_and_padded(docs_cfg):
  seq_len, bs = 128, 8
  val = data.load_documents(docs_cfg, "validation")
  expected = np.concatenate([tok.ByteTokenizer().encode(t, add_bos=True, add_eos=True)
                             for t in val])
  n_rows = -(-len(expected) // seq_len)
  batches = data.make_eval_batches(docs_cfg, seq_len=seq_len, batch_size=bs, num_batches=10_000)
  assert len(batches) == -(-n_rows // bs)                 # the split ran out
  again = data.make_eval_batches(docs_cfg, seq_len=seq_len, batch_size=bs, num_batches=10_000)
  for a, b in zip(batches, again):
    for k in a:
      assert np.array_equal(a[k], b[k])
  tokens = _stream_tokens(batches)
  seg = np.concatenate([b["segment_ids"].reshape(-1) for b in batches])
  pos = np.concatenate([b["positions"].reshape(-1) for b in batches])
  assert np.array_equal(tokens[seg > 0], expected)       # stored order, nothing lost
  assert np.all(tokens[seg == 0] == PAD) and np.all(pos[seg == 0] == 0)
  assert np.all(seg[len(expected):] == 0) and np.all(seg[:len(expected)] > 0)
  last = batches[-1]
  assert np.all(last["tokens"][-1] == PAD) or n_rows % bs == 0
  # A prefix is the same batches.
  two = data.make_eval_batches(docs_cfg, seq_len=seq_len, batch_size=bs, num_batches=2)
  assert len(two) == 2 and all(np.array_equal(two[i]["tokens"], batches[i]["tokens"])
                               for i in range(2))


def test_eval_sharding_partitions_global_batches(docs_cfg):
  full = data.make_eval_batches(docs_cfg, seq_len=32, batch_size=8, num_batches=3)
  parts = [data.make_eval_batches(docs_cfg, seq_len=32, batch_size=8, num_batches=3,
                                  process_index=p, process_count=2) for p in range(2)]
  assert len(parts[0]) == len(parts[1]) == len(full) == 3
  for i, b in enumerate(full):
    for k in b:
      assert parts[0][i][k].shape == (4, 32)
      assert np.array_equal(np.concatenate([parts[0][i][k], parts[1][i][k]]), b[k])


# --------------------------------------------------------------------------
# Shuffling, sharding, checkpointing
# --------------------------------------------------------------------------


def _take(cfg, n, **kw):
  kw = {"seq_len": 64, "batch_size": 4, "seed": 0, **kw}
  it = iter(data.make_train_dataset(cfg, **kw))
  return [next(it) for _ in range(n)]


def test_seed_determinism(stdlib_cfg):
  a, b, c = _take(stdlib_cfg, 5), _take(stdlib_cfg, 5), _take(stdlib_cfg, 5, seed=1)
  assert all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, b))
  assert not all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, c))


def test_new_order_each_epoch(tiny_cfg):
  # Each 20-document epoch is a permutation of the train split, and the two
  # epochs are in different orders.
  stream = _stream_tokens(_take(tiny_cfg, 60, seq_len=32, batch_size=4))
  docs = _documents_in_stream(stream)
  assert len(docs) >= 2 * TINY_TRAIN + 1
  first, second = docs[:TINY_TRAIN], docs[TINY_TRAIN:2 * TINY_TRAIN]
  assert stream[0] == BOS                                  # starts at a document
  assert sorted(first) == sorted(second) and len(set(first)) == TINY_TRAIN
  assert first != second


def test_process_sharding_is_disjoint(stdlib_cfg, tiny_cfg):
  p0 = _take(stdlib_cfg, 6, batch_size=8, process_index=0, process_count=2)
  p1 = _take(stdlib_cfg, 6, batch_size=8, process_index=1, process_count=2)
  assert all(b["tokens"].shape == (4, 64) for b in p0 + p1)
  rows0 = {r.tobytes() for b in p0 for r in b["tokens"]}
  rows1 = {r.tobytes() for b in p1 for r in b["tokens"]}
  assert not rows0 & rows1
  # Document level: processes read disjoint documents that cover the split.
  seen = []
  for p in range(2):
    stream = _stream_tokens(_take(tiny_cfg, 40, seq_len=32, batch_size=4, process_index=p,
                                  process_count=2))
    seen.append(set(_documents_in_stream(stream)))
  assert not seen[0] & seen[1]
  assert len(seen[0] | seen[1]) == TINY_TRAIN


@pytest.mark.parametrize("skip", [0, 5])
def test_get_state_set_state_resumes_exactly(stdlib_cfg, skip):
  ds = data.make_train_dataset(stdlib_cfg, seq_len=128, batch_size=16, seed=7)
  it = iter(ds)
  for _ in range(skip):
    next(it)
  state = it.get_state()
  assert isinstance(state, dict)
  assert json.loads(json.dumps(state)) == state             # JSON-native
  want = [next(it) for _ in range(3)]
  for restored_state in (state, json.loads(json.dumps(state))):
    it2 = iter(ds)
    it2.set_state(restored_state)
    got = [next(it2) for _ in range(3)]
    for w, g in zip(want, got):
      for k in w:
        assert np.array_equal(w[k], g[k])


# --------------------------------------------------------------------------
# Other (local) TFDS datasets and errors
# --------------------------------------------------------------------------


def test_local_custom_dataset_by_name(tiny_cfg, no_network):
  texts = data.load_documents(tiny_cfg, "train")
  assert sorted(texts) == sorted(_tiny_text(i) for i in range(TINY_TRAIN))
  b = _take(tiny_cfg, 3, seq_len=32, batch_size=4)[0]
  assert b["tokens"].shape == (4, 32) and b["tokens"][0, 0] == BOS
  evals = data.make_eval_batches(tiny_cfg, seq_len=32, batch_size=4, num_batches=100)
  eval_docs = _documents_in_stream(_stream_tokens(evals))
  assert sorted(d.decode() for d in eval_docs) == sorted(_tiny_text(i) for i in range(100, 104))


def test_invalid_utf8_is_replaced():
  rec = {"text": b"caf\xc3\xa9 \xff!"}
  assert sources._as_text(rec["text"]) == "café \ufffd!"
  ids = pipeline._Tokenize("text")(rec)["tokens"]
  assert ids[0] == BOS and ids[-1] == EOS
  assert tok.ByteTokenizer().decode(ids) == "café \ufffd!"


def test_unknown_dataset(tmp_path, no_network):
  with pytest.raises(data.DataError, match="unknown dataset 'no_such_corpus_xyz'") as e:
    data.load_source(DataConfig(name="no_such_corpus_xyz", data_dir=str(tmp_path)), "train")
  assert str(tmp_path) in str(e.value)


def test_known_but_not_prepared_never_downloads(tmp_path, no_network):
  d = str(tmp_path / "empty")
  with pytest.raises(data.DataError, match="'tiny_shakespeare' is not prepared") as e:
    data.make_train_dataset(DataConfig(name="tiny_shakespeare", data_dir=d), seq_len=8,
                            batch_size=2, seed=0)
  assert d in str(e.value) and "tfds build tiny_shakespeare" in str(e.value)
  assert not os.path.exists(d) or not os.listdir(d)         # nothing written


def test_missing_split_and_bad_text_feature(tiny_cfg, stdlib_cfg):
  with pytest.raises(data.DataError, match="no usable split 'validation'"):
    data.load_source(tiny_cfg, "validation")
  with pytest.raises(data.DataError, match="no feature 'body'.*'content', 'label'"):
    data.load_source(DataConfig(name=TINY, text_feature="body", data_dir=tiny_cfg.data_dir),
                     "train")
  with pytest.raises(data.DataError, match="'label'.*not a scalar text feature"):
    data.load_source(DataConfig(name=TINY, text_feature="label", data_dir=tiny_cfg.data_dir),
                     "train")
  with pytest.raises(data.DataError, match="python_stdlib.*no feature 'content'"):
    data.load_source(DataConfig(name="python_stdlib", text_feature="content",
                                data_dir=stdlib_cfg.data_dir), "train")


def test_batch_not_divisible_by_process_count(stdlib_cfg):
  with pytest.raises(data.DataError, match="not divisible by process_count=3"):
    data.make_train_dataset(stdlib_cfg, seq_len=16, batch_size=8, seed=0, process_index=0,
                            process_count=3)
  with pytest.raises(data.DataError, match="not divisible"):
    data.make_eval_batches(stdlib_cfg, seq_len=16, batch_size=8, num_batches=1, process_count=3)


# --------------------------------------------------------------------------
# Local files (data.name = "text_files")
# --------------------------------------------------------------------------


def _write_project(root) -> dict[str, str]:
  """A small source tree; returns {name relative to root: text}."""
  files = {f"pkg/mod{i}.py": f"def f{i}():\n  return {i}  # ünï 🚀\n" * (i + 1) for i in range(8)}
  files.update({"pkg/sub/deep.py": "x = 1\n", "top.py": "import pkg\n", "notes.md": "# notes\n"})
  for name, text in files.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text, encoding="utf-8")
  return files


def _text_files_docs(cfg) -> dict[str, dict[str, str]]:
  out = {}
  for split in ("train", "validation"):
    src = data.load_source(cfg, split)
    out[split] = {src[i]["name"].decode(): src[i]["text"].decode() for i in range(len(src))}
  return out


def _builds(data_dir) -> set[str]:
  root = os.path.join(data_dir, "text_files")
  return {d for d in os.listdir(root) if not d.startswith(".")} if os.path.isdir(root) else set()


def test_text_files_build_split_and_rebuild_on_change(tmp_path, no_network):
  proj = tmp_path / "proj"
  files = _write_project(proj)
  ddir = str(tmp_path / "tfds")
  # Two overlapping patterns (top.py matched twice) and recursive '**'.
  cfg = DataConfig(name="text_files", data_dir=ddir,
                   files=f"{proj}/**/*.py, {proj}/top.py")
  py = {n: t for n, t in files.items() if n.endswith(".py")}
  docs = _text_files_docs(cfg)
  assert {**docs["train"], **docs["validation"]} == py            # one document per file
  assert not docs["train"].keys() & docs["validation"].keys()
  assert data.text_files_splits(sorted(py)) == {n: s for s in docs for n in docs[s]}
  assert docs["train"] and docs["validation"]
  first = _builds(ddir)
  assert len(first) == 1
  # Unchanged files: the build is reused (no new folder, same documents).
  assert _text_files_docs(cfg) == docs and _builds(ddir) == first
  # Pipeline: packed training rows decode to file contents.
  stream = _stream_tokens(_take(cfg, 4, seq_len=32, batch_size=4))
  assert all(d.decode() in docs["train"].values() for d in _documents_in_stream(stream))
  # An edited file (new size and mtime), a touched file (mtime only), an added
  # file and a removed file each give a new build with the new contents.
  changes = [
      lambda: (proj / "pkg/mod1.py").write_text("edited = True\n"),
      lambda: os.utime(proj / "top.py", ns=(1, 1)),
      lambda: (proj / "pkg/new.py").write_text("new = 1\n"),
      lambda: (proj / "pkg/mod2.py").unlink(),
  ]
  seen = set(first)
  for change in changes:
    change()
    now = _text_files_docs(cfg)
    builds = _builds(ddir)
    assert len(builds - seen) == 1, change
    seen = builds
    expected = {str(p.relative_to(proj)): p.read_text() for p in proj.rglob("*.py")}
    assert {**now["train"], **now["validation"]} == expected


def test_text_files_names_and_splits(tmp_path, monkeypatch):
  proj = tmp_path / "proj"
  _write_project(proj)
  monkeypatch.chdir(tmp_path)
  # Names are relative to the pattern's folder part, so they (and the split)
  # do not depend on the working directory or on where the folder lives.
  rel = data.match_text_files("proj/pkg/**/*.py")
  absolute = data.match_text_files(f"{proj}/pkg/**/*.py")
  assert [f.name for f in rel] == [f.name for f in absolute]
  assert "sub/deep.py" in {f.name for f in rel} and "mod0.py" in {f.name for f in rel}
  assert [f.name for f in data.match_text_files("proj/*.md")] == ["notes.md"]
  assert all(os.path.isabs(f.path) for f in rel)
  # The split is the embedded corpora's hash rule, salted with "text_files" ...
  names = [f"f{i}.py" for i in range(400)]
  splits = data.text_files_splits(names)
  assert splits == {n: data.split_for_name("text_files", n) for n in names}
  assert 5 <= sum(s == "validation" for s in splits.values()) <= 40
  # ... except that small folders get one document in each split.
  for k in (2, 3, 5):
    small = data.text_files_splits(names[:k])
    assert sorted(set(small.values())) == ["train", "validation"]
    assert data.text_files_splits(list(reversed(names[:k]))) == small


def test_text_files_skips_non_utf8_and_empty_with_a_warning(tmp_path, caplog):
  proj = tmp_path / "p"
  proj.mkdir()
  for i in range(3):
    (proj / f"ok{i}.txt").write_text(f"text {i}\n")
  (proj / "latin1.txt").write_bytes("café\n".encode("latin-1"))
  (proj / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
  (proj / "blank.txt").write_text("  \n")
  cfg = DataConfig(name="text_files", files=str(proj / "*.txt"), data_dir=str(tmp_path / "d"))
  with caplog.at_level("WARNING"):
    docs = _text_files_docs(cfg)
  assert sorted({**docs["train"], **docs["validation"]}) == ["ok0.txt", "ok1.txt", "ok2.txt"]
  log = caplog.text
  assert "skipped 2 of 6 matched files that are not valid UTF-8" in log
  assert "'latin1.txt' (byte 3)" in log and "'image.txt' (byte 0)" in log
  assert "skipped 1 empty or whitespace-only files: 'blank.txt'" in log


def test_text_files_errors_name_the_field_and_file(tmp_path, no_network):
  proj = tmp_path / "p"
  (proj / "sub").mkdir(parents=True)
  (proj / "a.py").write_text("a = 1\n")
  ddir = str(tmp_path / "d")

  def load(files):
    return data.load_source(DataConfig(name="text_files", files=files, data_dir=ddir), "train")

  with pytest.raises(data.DataError, match=r"data\.files pattern '.*/nothing/\*\*/\*\.py' "
                                           r"matches no file"):
    load(f"{proj}/a.py,{proj}/nothing/**/*.py")       # the second pattern is named
  with pytest.raises(data.DataError, match=r"matches no file.*folder\(s\) only: use "
                                           r"'.*/sub/\*\*/\*'"):
    load(f"{proj}/sub")
  os.symlink(proj / "gone.py", proj / "broken.py")
  with pytest.raises(data.DataError, match=r"data\.files: cannot read '.*broken\.py' .*No such "
                                           r"file"):
    load(f"{proj}/*.py")
  os.unlink(proj / "broken.py")
  (proj / "b.py").write_bytes(b"\xff\xfe")
  with pytest.raises(data.DataError, match=r"data\.files: 1 of the 2 matched files are usable "
                                           r"UTF-8 .* need at least 2 .*'b\.py' at byte 0"):
    load(f"{proj}/*.py")
  with pytest.raises(data.DataError, match="data.files"):
    data.match_text_files("a.py,,b.py")
  assert not [d for d in _builds(ddir) if "incomplete" in d]   # nothing half-built kept


@pytest.mark.cpu_only
def test_text_files_config_and_cli(tmp_path):
  from mtp.config import ConfigError
  from tests.conftest import tiny_config
  with pytest.raises(ConfigError, match=r"data\.files=''.*comma-separated list"):
    tiny_config(data=dict(name="text_files"))
  with pytest.raises(ConfigError, match=r"data\.files='x\.py'.*empty unless "
                                        r"data\.name='text_files'"):
    tiny_config(data=dict(name="python_docs", files="x.py"))
  assert tiny_config(data=dict(name="text_files", files="a/*.py,b/**/*.md")).data.files
  # The CLI passes a comma-separated override through as one string.
  (tmp_path / "a.py").write_text("a = 1\n")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(data.__file__))))
  r = subprocess.run(
      [sys.executable, "-m", "train", "--config", "configs/tiny.py",
       "--workdir", str(tmp_path / "w"), "--config.data.name=text_files",
       f"--config.data.files={tmp_path}/*.py,{tmp_path}/missing/**/*.txt",
       f"--config.data.data_dir={tmp_path / 'd'}"],
      cwd=root, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
      timeout=300)
  assert r.returncode == 2, r.stderr[-2000:]
  assert f"data.files pattern '{tmp_path}/missing/**/*.txt' matches no file" in r.stderr
