"""Text data: TFDS builders for the embedded corpora and the grain pipeline.

Datasets (``DataConfig.name``):

- ``python_stdlib`` (code): the running interpreter's standard-library ``.py``
  files (``sysconfig.get_paths()["stdlib"]``). Skipped: ``site-packages`` /
  ``dist-packages``, ``__pycache__``, test directories (any path component
  named ``test``, ``tests`` or ``idle_test``: Linux distributions ship them
  separately or not at all, so leaving them out keeps the corpus the same for
  every install of one Python version), empty (or whitespace-only) files and
  files that are not valid UTF-8. One document per file; ``name`` is the path
  relative to the stdlib directory, with ``/`` separators.
- ``python_docs`` (prose): ``pydoc_data.topics.topics``, one document per
  help topic; ``name`` is the topic key.
- ``text_files``: local files named by ``DataConfig.files``, comma-separated
  glob patterns (``**`` matches any number of folders; ``~`` is expanded;
  relative patterns are relative to the working directory; as with
  ``glob``, names starting with ``.`` are matched only by a pattern that
  spells the dot). One document per file, the whole file; ``name`` is the
  path relative to the pattern's folder part (the components before the
  first one with ``*``, ``?`` or ``[``), with ``/`` separators. Folders
  matched by a pattern are ignored; a file matched by two patterns is read
  once. Files that are not valid UTF-8 (binaries, Latin-1 text) and empty or
  whitespace-only files are skipped, with their count and the first names
  in a warning (a broad pattern such as ``src/**/*`` commonly catches
  images or ``.pyc`` files: stopping at each would force listing
  extensions); a ``DataError`` names the field and the pattern or file when
  a pattern matches no file, a matched file cannot be read, or fewer than 2
  usable documents remain. Built like the embedded corpora (below) into
  ``DATA_DIR/text_files/files-<fingerprint>/1.0.0/``: the fingerprint hashes
  every matched file's path, name, size and modification time, so editing,
  adding or removing a file builds a new dataset on the next run (old
  builds stay until deleted; a run resumed after its files changed reads the
  new build from its saved iterator position, so it does not reproduce an
  uninterrupted run).
- any other TFDS dataset with a scalar text feature (``DataConfig.text_feature``,
  e.g. ``tiny_shakespeare``/``text``, ``lm1b``/``text``) that is already
  prepared in the data dir in a random-access format (``array_record``). Its
  bytes are decoded as UTF-8 with ``errors="replace"`` (invalid bytes become
  U+FFFD). Nothing is ever downloaded: a dataset that is not there is a
  ``DataError``. Prepare it once where there is network, e.g.
  ``tfds build tiny_shakespeare --data_dir=DIR --file_format=array_record``.

Embedded corpora are TFDS ``GeneratorBasedBuilder``s written as
``array_record`` (TensorFlow is neither needed nor imported). They are built
automatically on first use (no downloads; about 0.5 s for python_stdlib), under a file lock so that
racing processes build once, and TFDS itself writes into a temporary
``incomplete.*`` folder that is renamed when done. Their content depends on the
interpreter, so each has one builder config named after it
(``interpreter_tag()``, e.g. ``cpython-3.11.7``): the files live in
``DATA_DIR/python_stdlib/cpython-3.11.7/1.0.0/`` and two interpreters never mix
data.

Splits ``train`` / ``validation`` of the embedded corpora: a document is in
``validation`` iff the first 8 bytes of ``sha256("<corpus>/<name>")``, as an
integer mod 10 000, are below 500, i.e. 5% (``split_for_name``).
Deterministic across runs, machines and Python versions; a validation document
is never trained on. The corpus name salts the hash so the two corpora are
split independently (salting also happens to give python_docs 3 validation
topics instead of 1 with the bare name). ``text_files`` uses the same rule on
its document names, with one exception for small folders: when the hash puts
no document in ``validation`` (or every one), the document with the lowest
(highest) bucket is moved, so both splits hold at least one document.

Pipeline (grain): documents are tokenized as ``[BOS] + UTF-8 bytes + [EOS]``
(``mtp.tokenizer.ByteTokenizer``) and packed by concat-then-split
(``grain.experimental.ConcatThenSplitIterDataset``) into rows of ``seq_len``
tokens. Long documents continue into the next row(s) instead of being
truncated. Per row, ``segment_ids`` number the document pieces 1, 2, ... (0 =
padding) and ``positions`` count from 0 within each piece, restarting at 0 in
every row, also for a piece that continues a document from the previous row
(which then does not start with BOS). Padding (tokens ``PAD_ID``, segment 0,
position 0) only occurs at the end of a finite stream (eval); training rows are
always full. Batches are ``dict(tokens, segment_ids, positions)`` of numpy
int32 ``[B, seq_len]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import itertools
import json
import logging as py_logging
import os
import stat
import sys
import sysconfig
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import grain
import numpy as np
import tensorflow_datasets as tfds
from absl import logging
from tensorflow_datasets.core import read_only_builder
from tensorflow_datasets.core import registered as tfds_registered

from mtp import quiet
from mtp import tokenizer as tok
from mtp.config import DataConfig

EMBEDDED_DATASETS = ("python_stdlib", "python_docs")
TEXT_FILES = "text_files"
TRAIN_SPLIT = "train"
VALIDATION_SPLIT = "validation"
VALIDATION_PER_10K = 500          # 5% of documents go to validation
DEFAULT_DATA_DIR = os.path.join("~", ".cache", "mtp", "tensorflow_datasets")
DATA_DIR_ENV = "MTP_DATA_DIR"
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests",
                               "idle_test"})
# Record formats tfds can read by index without TensorFlow.
_RANDOM_ACCESS_FORMATS = ("array_record", "parquet")
_TOKENIZER = tok.ByteTokenizer()


class DataError(ValueError):
  """A dataset, split or feature is unknown, not prepared, or unusable; or the
  pipeline arguments are inconsistent (e.g. batch not divisible by processes)."""


# ----------------------------------------------------------------------------
# Embedded corpora (TFDS builders)
# ----------------------------------------------------------------------------


def interpreter_tag() -> str:
  """Builder-config name for this interpreter, e.g. ``"cpython-3.11.7"``
  (``"cpython-3.13.0rc1"`` for pre-releases)."""
  v = sys.version_info
  level = {"alpha": "a", "beta": "b", "candidate": "rc"}.get(v.releaselevel)
  suffix = f"{level}{v.serial}" if level else ""
  return f"{sys.implementation.name}-{v.major}.{v.minor}.{v.micro}{suffix}"


def _bucket(corpus: str, name: str) -> int:
  digest = hashlib.sha256(f"{corpus}/{name}".encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") % 10_000


def split_for_name(corpus: str, name: str) -> str:
  """``"validation"`` for 5% of document names (stable sha256 hash of
  ``"<corpus>/<name>"``), else ``"train"``."""
  return VALIDATION_SPLIT if _bucket(corpus, name) < VALIDATION_PER_10K else TRAIN_SPLIT


def stdlib_documents() -> Iterator[tuple[str, str]]:
  """Yields ``(relative_path, text)`` for the interpreter's stdlib ``.py``
  files, sorted by path (see the module docstring for what is skipped)."""
  root = sysconfig.get_paths()["stdlib"]
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS)
    for fn in sorted(filenames):
      if not fn.endswith(".py"):
        continue
      path = os.path.join(dirpath, fn)
      try:
        with open(path, "rb") as f:
          raw = f.read()
        text = raw.decode("utf-8")
      except (OSError, UnicodeDecodeError):
        continue
      if not text.strip():
        continue
      yield os.path.relpath(path, root).replace(os.sep, "/"), text


def docs_documents() -> Iterator[tuple[str, str]]:
  """Yields ``(topic, text)`` from ``pydoc_data.topics.topics``, sorted.

  Raises:
    DataError: this Python install has no ``pydoc_data`` module.
  """
  try:
    from pydoc_data.topics import topics
  except ImportError as e:
    raise DataError(f"python_docs: this Python ({sys.version.split()[0]}) has no "
                    f"pydoc_data.topics module") from e
  for key in sorted(topics):
    if topics[key].strip():
      yield key, topics[key]


def _tfds_is_registered(name: str) -> bool:
  registry = getattr(tfds_registered, "_DATASET_REGISTRY", {})
  return name in registry


class _SaysWhatItBuilds:
  """Mixin for our TFDS builders. TFDS prints "Downloading and preparing
  dataset Unknown size ..." and "... downloaded and prepared to ..." to stdout
  from these two hooks; nothing is downloaded here, so instead one line on
  stderr says what is built from what, and where."""

  def _source(self) -> str:
    """Where the documents come from, for the build line."""
    raise NotImplementedError

  def _log_download_bytes(self):
    print(f"building dataset {self.name} from {self._source()} into {self.data_dir} (once; "
          "nothing is downloaded)", file=sys.stderr, flush=True)

  def _log_download_done(self):
    pass


class _EmbeddedCorpus(_SaysWhatItBuilds, tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Base for the corpora shipped with Python. One config: this interpreter."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  BUILDER_CONFIGS = [tfds.core.BuilderConfig(
      name=interpreter_tag(), description=f"Python {sys.version.split()[0]} ({sys.executable})")]
  _DESCRIPTION = ""

  # TFDS looks for a checksums file next to the builder's code; for builders
  # inside a package that lookup imports the `importlib_resources` backport,
  # which this environment lacks. Nothing is downloaded, so there is none.
  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls):
    return None

  def _documents(self) -> Iterator[tuple[str, str]]:
    raise NotImplementedError

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=self._DESCRIPTION,
        features=tfds.features.FeaturesDict({"text": tfds.features.Text(),
                                             "name": tfds.features.Text()}),
        metadata=tfds.core.MetadataDict(python_version=sys.version,
                                        validation_per_10k=VALIDATION_PER_10K),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    docs = {TRAIN_SPLIT: [], VALIDATION_SPLIT: []}
    for name, text in self._documents():
      docs[split_for_name(self.name, name)].append((name, text))
    return {split: self._generate_examples(d) for split, d in docs.items()}

  def _generate_examples(self, docs):
    for name, text in docs:
      yield name, {"text": text, "name": name}


class PythonStdlib(_EmbeddedCorpus, skip_registration=_tfds_is_registered("python_stdlib")):
  """The running interpreter's standard-library ``.py`` files (code)."""

  _DESCRIPTION = ("Standard-library .py files of the interpreter that built the dataset "
                  "(no site-packages, no test directories).")

  def _source(self):
    return f"the standard library in {sysconfig.get_paths()['stdlib']}"

  def _documents(self):
    return stdlib_documents()


class PythonDocs(_EmbeddedCorpus, skip_registration=_tfds_is_registered("python_docs")):
  """The interpreter's ``pydoc_data.topics`` help texts (prose)."""

  _DESCRIPTION = "pydoc help topics (pydoc_data.topics.topics), one document per topic."

  def _source(self):
    return "the pydoc_data.topics help texts"

  def _documents(self):
    return docs_documents()


_EMBEDDED_BUILDERS = {"python_stdlib": PythonStdlib, "python_docs": PythonDocs}


@contextlib.contextmanager
def _file_lock(path: str):
  """Exclusive advisory lock (``fcntl.flock``) on ``path`` for the block."""
  with open(path, "a+") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _quiet_tfds():
  """Hides TFDS progress bars for the block, restoring the previous setting."""
  from tensorflow_datasets.core.utils import tqdm_utils
  previous = getattr(tqdm_utils, "_active", True)
  tfds.display_progress_bar(False)
  try:
    yield
  finally:
    tfds.display_progress_bar(previous)


def _is_prepared(builder: tfds.core.DatasetBuilder) -> bool:
  """``builder.is_prepared()`` without TFDS's warning that the version folder
  has no dataset_info.json (true of every dataset not built yet)."""
  with quiet.absl_messages_dropped(*quiet.TFDS_BUILDING):
    return builder.is_prepared()


def prepare_embedded(name: str, data_dir: str) -> tfds.core.DatasetBuilder:
  """Builds embedded corpus ``name`` under ``data_dir`` unless present; returns
  its builder. Safe when several processes call it at once (file lock; TFDS
  writes into a temporary folder and renames it).

  Raises:
    DataError: ``name`` is not an embedded corpus, or building failed.
  """
  if name not in _EMBEDDED_BUILDERS:
    raise DataError(f"'{name}' is not an embedded corpus; those are {EMBEDDED_DATASETS}")
  cls = _EMBEDDED_BUILDERS[name]
  config = interpreter_tag()
  kwargs = dict(data_dir=data_dir, config=config, file_format="array_record")
  builder = cls(**kwargs)
  if _is_prepared(builder):
    return builder
  try:
    os.makedirs(data_dir, exist_ok=True)
    with _file_lock(os.path.join(data_dir, f".{name}-{config}.lock")):
      builder = cls(**kwargs)       # re-check: another process may have built it
      if not _is_prepared(builder):
        with tempfile.TemporaryDirectory(prefix="mtp_tfds_dl_") as dl_dir, _quiet_tfds():
          builder.download_and_prepare(
              download_dir=dl_dir, file_format="array_record",
              download_config=tfds.download.DownloadConfig(try_download_gcs=False))
        builder = cls(**kwargs)
  except DataError:
    raise
  except Exception as e:  # noqa: BLE001 - report any build failure uniformly
    raise DataError(f"building embedded dataset '{name}' (config {config}) in data_dir "
                    f"'{data_dir}' failed: {type(e).__name__}: {e}") from e
  return builder


# ----------------------------------------------------------------------------
# Local files (data.name = "text_files")
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TextFile:
  """One file matched by ``DataConfig.files``.

  name: path relative to its pattern's folder part, ``/`` separators (the
    document name that decides the split); path: absolute path;
    size: bytes; mtime_ns: modification time (ns since the epoch).
  """
  name: str
  path: str
  size: int
  mtime_ns: int


def _pattern_folder(pattern: str) -> str:
  """The leading components of ``pattern`` without glob magic (``*?[``),
  e.g. ``"src/pkg"`` for ``"src/pkg/**/*.py"``; ``"."`` if none."""
  parts = pattern.split(os.sep)
  keep = list(itertools.takewhile(lambda p: glob.escape(p) == p, parts[:-1]))
  folder = os.sep.join(keep)
  if not folder and pattern.startswith(os.sep):
    folder = os.sep
  return folder or "."


def match_text_files(files: str) -> list[TextFile]:
  """The files matched by ``files`` (``DataConfig.files``: comma-separated
  glob patterns, ``**`` recursive, ``~`` expanded), sorted by path, each
  once; folders are ignored.

  Raises:
    DataError: an empty pattern, a pattern that matches no file (the message
      names ``data.files``, the pattern and the working directory), or a
      matched path that cannot be stat'ed (e.g. a broken symlink) or is not a
      regular file (names the path).
  """
  patterns = [p.strip() for p in files.split(",")]
  if not files.strip() or not all(patterns):
    raise DataError(f"data.files={files!r} must be a comma-separated list of non-empty glob "
                    "patterns, e.g. 'src/**/*.py,docs/*.md'")
  found: dict[str, TextFile] = {}
  for pattern in patterns:
    expanded = os.path.expanduser(pattern)
    folder = os.path.abspath(_pattern_folder(expanded))
    n_files = n_dirs = 0
    for match in sorted(glob.glob(expanded, recursive=True)):
      path = os.path.abspath(match)
      if os.path.isdir(path):
        n_dirs += 1
        continue
      try:
        st = os.stat(path)
      except OSError as e:
        raise DataError(f"data.files: cannot read {match!r} (matched by {pattern!r}): "
                        f"{e.strerror or e}") from e
      if not stat.S_ISREG(st.st_mode):
        raise DataError(f"data.files: {match!r} (matched by {pattern!r}) is not a regular file")
      n_files += 1
      if path not in found:
        name = os.path.relpath(path, folder).replace(os.sep, "/")
        found[path] = TextFile(name, path, int(st.st_size), int(st.st_mtime_ns))
    if not n_files:
      hint = (f"; it matches {n_dirs} folder(s) only: use '{pattern.rstrip('/')}/**/*' for the "
              "files below" if n_dirs else "")
      raise DataError(f"data.files pattern {pattern!r} matches no file (relative to "
                      f"{os.getcwd()!r}; names starting with '.' need a pattern that spells the "
                      f"dot){hint}")
  return [found[p] for p in sorted(found)]


def text_files_fingerprint(files: list[TextFile]) -> str:
  """16 hex digits of sha256 over every file's (name, path, size, mtime_ns):
  any change to the set of files, a name, a size or a modification time
  gives a new fingerprint (and so a new build)."""
  blob = json.dumps([[f.name, f.path, f.size, f.mtime_ns] for f in files], ensure_ascii=False)
  return hashlib.sha256(f"{TEXT_FILES}/v1\n{blob}".encode("utf-8", "surrogatepass")).hexdigest()[:16]


def text_files_splits(names: list[str]) -> dict[str, str]:
  """Split of each document name: ``split_for_name("text_files", name)``,
  except that when that leaves ``validation`` (``train``) empty and there are
  at least 2 names, the name with the lowest (highest) hash bucket moves
  there, so both splits are non-empty. Deterministic in the set of names."""
  out = {n: split_for_name(TEXT_FILES, n) for n in names}
  if len(set(names)) >= 2:
    ordered = sorted(set(names), key=lambda n: (_bucket(TEXT_FILES, n), n))
    if VALIDATION_SPLIT not in out.values():
      out[ordered[0]] = VALIDATION_SPLIT
    if TRAIN_SPLIT not in out.values():
      out[ordered[-1]] = TRAIN_SPLIT
  return out


def read_text_files(files: list[TextFile]) -> tuple[list[tuple[TextFile, str]], dict[str, Any]]:
  """Reads and decodes ``files``. Files that are not valid UTF-8, and empty or
  whitespace-only files, are skipped (not an error; see the module docstring).

  Returns:
    (documents, skipped): documents is a list of (file, text) for the usable
    files in input order; skipped is ``{"not_utf8": [(name, byte_offset)],
    "empty": [name]}``.

  Raises:
    DataError: a file cannot be read (names the file and the OS error).
  """
  docs, not_utf8, empty = [], [], []
  for f in files:
    try:
      with open(f.path, "rb") as fh:
        raw = fh.read()
    except OSError as e:
      raise DataError(f"data.files: cannot read {f.path!r}: {e.strerror or e}") from e
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      not_utf8.append((f.name, int(e.start)))
      continue
    if not text.strip():
      empty.append(f.name)
      continue
    docs.append((f, text))
  return docs, {"not_utf8": not_utf8, "empty": empty}


class TextFiles(_SaysWhatItBuilds, tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Local files as a corpus (``data.name="text_files"``). One builder config
  per fingerprint of the matched files (``files-<16 hex>``); construct with
  ``TextFiles(files=[TextFile...], config=BuilderConfig(name=...), ...)``."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls):   # see _EmbeddedCorpus.code_path
    return None

  def __init__(self, *, files: list[TextFile] = (), **kwargs):
    self._text_files = list(files)
    super().__init__(**kwargs)

  def _source(self):
    return f"{len(self._text_files)} local files ({self.builder_config.description})"

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description="Local text files, one document per file (mtp.data, data.name=text_files).",
        features=tfds.features.FeaturesDict({"text": tfds.features.Text(),
                                             "name": tfds.features.Text()}),
        metadata=tfds.core.MetadataDict(validation_per_10k=VALIDATION_PER_10K),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    docs, skipped = read_text_files(self._text_files)
    n = len(self._text_files)
    if skipped["not_utf8"]:
      first = ", ".join(f"{name!r} (byte {at})" for name, at in skipped["not_utf8"][:3])
      logging.warning("text_files: skipped %d of %d matched files that are not valid UTF-8: %s%s",
                      len(skipped["not_utf8"]), n, first,
                      ", ..." if len(skipped["not_utf8"]) > 3 else "")
    if skipped["empty"]:
      logging.warning("text_files: skipped %d empty or whitespace-only files: %s%s",
                      len(skipped["empty"]), ", ".join(map(repr, skipped["empty"][:3])),
                      ", ..." if len(skipped["empty"]) > 3 else "")
    if len(docs) < 2:
      detail = ""
      if skipped["not_utf8"]:
        detail += (f"; {len(skipped['not_utf8'])} not valid UTF-8 (first: "
                   f"{skipped['not_utf8'][0][0]!r} at byte {skipped['not_utf8'][0][1]})")
      if skipped["empty"]:
        detail += f"; {len(skipped['empty'])} empty"
      raise DataError(f"data.files: {len(docs)} of the {n} matched files are usable UTF-8 text "
                      f"documents; need at least 2 (one is held out for validation){detail}")
    splits = text_files_splits([f.name for f, _ in docs])
    by_split = {TRAIN_SPLIT: [], VALIDATION_SPLIT: []}
    for f, text in docs:
      by_split[splits[f.name]].append((f, text))
    return {split: self._generate_examples(d) for split, d in by_split.items()}

  def _generate_examples(self, docs):
    for f, text in docs:
      yield f.path, {"text": text, "name": f.name}


class _DropCustomConfigWarning(py_logging.Filter):
  """TFDS warns "Using custom data configuration" for every builder made
  from a BuilderConfig instance; for text_files that is the normal case."""

  def filter(self, record):
    return not str(record.msg).startswith("Using custom data configuration")


def prepare_text_files(files: str, data_dir: str) -> tfds.core.DatasetBuilder:
  """Builds the ``text_files`` dataset of ``files`` (``DataConfig.files``)
  under ``data_dir`` unless a build with the same fingerprint is there;
  returns its builder. Safe for concurrent callers (file lock).

  Raises:
    DataError: as ``match_text_files`` and ``read_text_files``; fewer than 2
      usable documents; or the build failed.
  """
  matched = match_text_files(files)
  config = tfds.core.BuilderConfig(name=f"files-{text_files_fingerprint(matched)}",
                                   description=f"data.files={files!r}")
  quiet = _DropCustomConfigWarning()
  absl_logger = py_logging.getLogger("absl")
  def make():
    absl_logger.addFilter(quiet)
    try:
      return TextFiles(files=matched, config=config, data_dir=data_dir,
                       file_format="array_record")
    finally:
      absl_logger.removeFilter(quiet)
  builder = make()
  if _is_prepared(builder):
    return builder
  try:
    os.makedirs(data_dir, exist_ok=True)
    with _file_lock(os.path.join(data_dir, f".{TEXT_FILES}-{config.name}.lock")):
      builder = make()
      if not _is_prepared(builder):
        with tempfile.TemporaryDirectory(prefix="mtp_tfds_dl_") as dl_dir, _quiet_tfds():
          builder.download_and_prepare(
              download_dir=dl_dir, file_format="array_record",
              download_config=tfds.download.DownloadConfig(try_download_gcs=False))
        builder = make()
  except DataError:
    raise
  except Exception as e:  # noqa: BLE001 - report any build failure uniformly
    raise DataError(f"building the text_files dataset of data.files={files!r} in data_dir "
                    f"'{data_dir}' failed: {type(e).__name__}: {e}") from e
  return builder


# ----------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------


def resolve_data_dir(cfg: DataConfig) -> str:
  """The TFDS data dir: ``cfg.data_dir`` if non-empty, else ``$MTP_DATA_DIR``
  if set, else ``~/.cache/mtp/tensorflow_datasets``; user-expanded, absolute.
  Embedded corpora live below it in per-interpreter config folders."""
  path = cfg.data_dir or os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR
  return os.path.abspath(os.path.expanduser(path))


def _prepared_datasets(data_dir: str) -> list[str]:
  """Names of the folders in ``data_dir`` that look like TFDS datasets."""
  try:
    return sorted(d for d in os.listdir(data_dir) if not d.startswith((".", "downloads"))
                  and os.path.isdir(os.path.join(data_dir, d)))
  except OSError:
    return []


def _is_known_tfds_name(name: str) -> bool:
  """Whether the TFDS catalogue (local registry only, no network) knows ``name``."""
  base = name.split("/")[0].split(":")[0]
  try:
    tfds.builder_cls(base)
    return True
  except Exception:  # noqa: BLE001 - unknown, or its module fails to import
    return False


def _open_builder(cfg: DataConfig, data_dir: str) -> tfds.core.DatasetBuilder:
  name = cfg.name
  if name in _EMBEDDED_BUILDERS:
    return prepare_embedded(name, data_dir)
  if name == TEXT_FILES:
    return prepare_text_files(cfg.files, data_dir)
  try:
    # Reads only what is on disk (dataset_info.json, features.json); never
    # runs the dataset's generation code (which may need TensorFlow) and never
    # downloads. Same reader as tfds.data_source(..., download=False).
    builder = read_only_builder.builder_from_files(name, data_dir=data_dir)
  except Exception as e:  # noqa: BLE001 - DatasetNotFoundError, bad name syntax, ...
    on_disk = _prepared_datasets(data_dir)
    if _is_known_tfds_name(name):
      what = (f"TFDS dataset '{name}' is not prepared in data_dir '{data_dir}' (nothing is "
              f"downloaded automatically). Prepare it where there is network, e.g. `tfds build "
              f"{name} --data_dir={data_dir} --file_format=array_record`")
    else:
      what = (f"unknown dataset '{name}': not an embedded corpus {EMBEDDED_DATASETS}, not in "
              f"the TFDS catalogue and not prepared in data_dir '{data_dir}'")
    raise DataError(f"{what}. Datasets found in data_dir: {on_disk or 'none'}. "
                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
  fmt = builder.info.file_format
  fmt_name = getattr(fmt, "value", str(fmt))
  if fmt_name not in _RANDOM_ACCESS_FORMATS:
    raise DataError(f"dataset '{name}' in data_dir '{data_dir}' is stored as '{fmt_name}', which "
                    f"cannot be read by index without TensorFlow; re-prepare it with "
                    f"--file_format=array_record (or convert it with `tfds convert_format`)")
  return builder


def _check_text_feature(builder: tfds.core.DatasetBuilder, cfg: DataConfig, data_dir: str):
  features = builder.info.features
  keys = sorted(features.keys()) if hasattr(features, "keys") else []
  if cfg.text_feature not in keys:
    raise DataError(f"dataset '{cfg.name}' in data_dir '{data_dir}' has no feature "
                    f"'{cfg.text_feature}' (data.text_feature); its features are {keys}")
  feature = features[cfg.text_feature]
  np_dtype = getattr(feature, "np_dtype", None)
  is_text = isinstance(feature, tfds.features.Text) or (
      tuple(getattr(feature, "shape", (None,))) == ()
      and np_dtype is not None and np.dtype(np_dtype).kind in "OSU")
  if not is_text:
    raise DataError(f"feature '{cfg.text_feature}' of dataset '{cfg.name}' in data_dir "
                    f"'{data_dir}' is not a scalar text feature ({feature!r}); pick one of {keys}")


def load_source(cfg: DataConfig, split: str):
  """Random-access source of the documents of ``split`` (builds an embedded
  corpus on first use).

  Returns:
    The TFDS data source (``tfds.data_source`` semantics, ``download=False``):
    ``len(src)`` documents; ``src[i]`` is a dict of features whose
    ``cfg.text_feature`` entry is the document as ``bytes`` (UTF-8, maybe
    invalid for other datasets). Record order is TFDS's deterministic
    (key-hashed) order. Usable as a ``grain.MapDataset.source``.

  Raises:
    DataError: unknown dataset name, dataset not prepared in the data dir or
      not in a random-access format, unknown split, missing or non-text
      ``text_feature``. Messages name the dataset, the data dir and what is
      missing.
  """
  data_dir = resolve_data_dir(cfg)
  builder = _open_builder(cfg, data_dir)
  _check_text_feature(builder, cfg, data_dir)
  try:
    builder.info.splits[split]
    return builder.as_data_source(split=split)
  except (ValueError, KeyError, NotImplementedError, OSError) as e:
    raise DataError(f"dataset '{cfg.name}' in data_dir '{data_dir}' has no usable split "
                    f"'{split}' (splits: {sorted(builder.info.splits.keys())}): {e}") from e


def _as_text(value: Any) -> str:
  """A text feature value (bytes, str or 0-d array of either) as ``str``;
  invalid UTF-8 becomes U+FFFD."""
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value.item()
  if isinstance(value, (bytes, np.bytes_)):
    return bytes(value).decode("utf-8", errors="replace")
  if isinstance(value, str):
    return str(value)
  raise DataError(f"text feature value must be bytes or str, got {type(value).__name__}")


def load_documents(cfg: DataConfig, split: str, limit: int | None = None) -> list[str]:
  """The first ``limit`` (all if None) documents of ``split`` as ``str``, in
  the source's stored order (UTF-8 decoded with ``errors="replace"``).

  Raises:
    DataError: as ``load_source``.
  """
  src = load_source(cfg, split)
  n = len(src) if limit is None else min(int(limit), len(src))
  return [_as_text(src[i][cfg.text_feature]) for i in range(n)]


# ----------------------------------------------------------------------------
# Pipeline
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Tokenize:
  """Record -> ``{"tokens": int32[n + 2]}`` = [BOS] + UTF-8 bytes + [EOS].
  Picklable (runs in grain worker processes)."""

  text_feature: str

  def __call__(self, record: Mapping[str, Any]) -> dict[str, np.ndarray]:
    text = _as_text(record[self.text_feature])
    return {"tokens": _TOKENIZER.encode(text, add_bos=True, add_eos=True)}


def _finalize(packed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """ConcatThenSplit output -> our batch dict (padding tokens set to PAD)."""
  seg = np.asarray(packed["tokens_segment_ids"], np.int32)
  tokens = np.where(seg == 0, tok.PAD_ID, packed["tokens"]).astype(np.int32)
  return {"tokens": tokens, "segment_ids": seg,
          "positions": np.asarray(packed["tokens_positions"], np.int32)}


def _json_safe(x: Any) -> Any:
  """State with tuples -> lists and numpy scalars -> Python scalars."""
  if isinstance(x, Mapping):
    return {k: _json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_json_safe(v) for v in x]
  if isinstance(x, np.generic):
    return x.item()
  return x


def _restore_slices(x: Any) -> Any:
  """Inverse of the one lossy step of ``_json_safe``: ConcatThenSplit compares
  its ``remainder_slices`` entries to the tuple ``(-1, -1)``, so JSON lists
  must become tuples again (a list there silently drops a document)."""
  if isinstance(x, Mapping):
    out = {}
    for k, v in x.items():
      if k == "remainder_slices" and isinstance(v, Mapping):
        out[k] = {f: tuple(s) for f, s in v.items()}
      else:
        out[k] = _restore_slices(v)
    return out
  if isinstance(x, list):
    return [_restore_slices(v) for v in x]
  return x


class _JsonStateIterator(grain.DatasetIterator):
  """Passes elements through; ``get_state`` is a JSON-native dict and
  ``set_state`` accepts it back (also after a JSON round trip)."""

  def __next__(self):
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return _json_safe(self._parent.get_state())

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(_restore_slices(state))

  def __str__(self) -> str:
    return "JsonStateIterator"


class JsonStateIterDataset(grain.IterDataset):
  """Wraps a pipeline so its iterator state survives ``json.dumps``/``loads``
  (as done by grain's orbax ``CheckpointHandler``)."""

  def __iter__(self) -> grain.DatasetIterator:
    return _JsonStateIterator(self._parent.__iter__())

  def __str__(self) -> str:
    return "JsonStateIterDataset"


def _check_sharding(batch_size: int, seq_len: int, process_index: int, process_count: int) -> int:
  if seq_len < 1:
    raise DataError(f"seq_len must be >= 1, got {seq_len}")
  if batch_size < 1:
    raise DataError(f"batch_size must be >= 1, got {batch_size}")
  if process_count < 1 or not 0 <= process_index < process_count:
    raise DataError(f"need 0 <= process_index < process_count, got process_index="
                    f"{process_index}, process_count={process_count}")
  if batch_size % process_count:
    raise DataError(f"global batch_size={batch_size} is not divisible by "
                    f"process_count={process_count}")
  return batch_size // process_count


def _packed_rows(cfg: DataConfig, docs: grain.MapDataset, seq_len: int,
                 read_options: grain.ReadOptions) -> grain.IterDataset:
  ds = docs.map(_Tokenize(cfg.text_feature)).to_iter_dataset(read_options)
  return grain.experimental.ConcatThenSplitIterDataset(ds, length_struct={"tokens": seq_len})


def make_train_dataset(cfg: DataConfig, *, seq_len: int, batch_size: int, seed: int,
                       process_index: int = 0, process_count: int = 1) -> grain.IterDataset:
  """Infinite, shuffled, packed training batches for this process.

  Documents of ``cfg.train_split`` are sharded by process (document
  ``i`` goes to process ``i % process_count``, so processes read disjoint
  data), globally shuffled with ``seed`` (a new order every epoch: grain folds
  the epoch into the shuffle seed), tokenized, packed (module docstring) and
  batched. With ``cfg.num_workers > 0`` the work runs in that many grain worker
  processes (``mp_prefetch``), which changes the row order but stays
  deterministic for a given ``num_workers``.

  Args:
    cfg: data config.
    seq_len: tokens per row (T).
    batch_size: global batch size (rows over all processes).
    seed: shuffle seed (int >= 0; taken mod 2**32).
    process_index, process_count: this JAX process and the number of them.

  Returns:
    ``grain.IterDataset``; ``iter(ds)`` yields ``dict(tokens, segment_ids,
    positions)``, numpy int32 ``[B, T]`` with ``B = batch_size //
    process_count``. The iterator is checkpointable: ``it.get_state()`` is a
    JSON-serializable dict and ``it.set_state(state)`` resumes the exact
    stream.

  Raises:
    DataError: as ``load_source``; batch_size not divisible by process_count;
      fewer documents than processes; bad sizes.
  """
  per_process = _check_sharding(batch_size, seq_len, process_index, process_count)
  src = load_source(cfg, cfg.train_split)
  if len(src) < process_count:
    raise DataError(f"split '{cfg.train_split}' of '{cfg.name}' has {len(src)} documents, fewer "
                    f"than process_count={process_count}")
  docs = grain.MapDataset.source(src)[process_index::process_count]
  docs = docs.shuffle(seed=int(seed) % 2**32).repeat()
  # One document feeds many rows and records are local: reading in the calling
  # thread was fastest (2 CPU cores; threads only add GIL contention).
  ds = _packed_rows(cfg, docs, seq_len, grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  ds = ds.batch(per_process, drop_remainder=True).map(_finalize)
  if cfg.num_workers > 0:
    from absl import flags
    if not flags.FLAGS.is_parsed():
      # grain workers read absl flags; outside an absl app use their defaults.
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.num_workers))
  return JsonStateIterDataset(ds)


def make_eval_batches(cfg: DataConfig, *, seq_len: int, batch_size: int, num_batches: int,
                      process_index: int = 0, process_count: int = 1) -> list[dict]:
  """The first ``num_batches`` packed batches of ``cfg.eval_split``, no shuffle.

  Every process packs the same global stream (documents in stored order) and
  takes rows ``[process_index * B, (process_index + 1) * B)`` of each global
  batch. So all processes get the same number of batches (collectives stay in
  step), their rows are disjoint, and the global eval set does not depend on
  ``process_count``. If the split runs out, fewer batches come back and the
  last one is padded with PAD rows (segment 0, position 0).

  Args:
    cfg: data config.
    seq_len: tokens per row (T).
    batch_size: global batch size; num_batches: at most this many batches.
    process_index, process_count: this JAX process and the number of them.

  Returns:
    list of ``dict(tokens, segment_ids, positions)``, numpy int32 ``[B, T]``,
    ``B = batch_size // process_count``.

  Raises:
    DataError: as ``load_source``; batch_size not divisible by process_count.
  """
  per_process = _check_sharding(batch_size, seq_len, process_index, process_count)
  if num_batches < 0:
    raise DataError(f"num_batches must be >= 0, got {num_batches}")
  src = load_source(cfg, cfg.eval_split)
  ds = _packed_rows(cfg, grain.MapDataset.source(src), seq_len,
                    grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  rows = [_finalize(r) for r in itertools.islice(iter(ds), num_batches * batch_size)]
  if not rows:
    return []
  stacked = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  n_pad = -len(rows) % batch_size
  if n_pad:
    stacked["tokens"] = np.concatenate(
        [stacked["tokens"], np.full((n_pad, seq_len), tok.PAD_ID, np.int32)])
    for k in ("segment_ids", "positions"):
      stacked[k] = np.concatenate([stacked[k], np.zeros((n_pad, seq_len), np.int32)])
  out = []
  for start in range(0, len(stacked["tokens"]), batch_size):
    lo = start + process_index * per_process
    out.append({k: np.ascontiguousarray(v[lo:lo + per_process]) for k, v in stacked.items()})
  return out


def held_out_prompts(dataset: str, n: int, prompt_bytes: int, seed: int = 0,
                     data_dir: str = "") -> list[str]:
  """n held-out prompts (str) of about ``prompt_bytes`` bytes (cut at a UTF-8
  boundary) from the validation split of ``dataset``, each starting at a
  line boundary of a different document (documents cycle when n exceeds
  them); deterministic for a seed. Raises DataError (unknown dataset, or no
  validation document longer than prompt_bytes + 64)."""
  docs = [d for d in load_documents(DataConfig(name=dataset, data_dir=data_dir), "validation")
          if len(d.encode()) > prompt_bytes + 64]
  if not docs:
    raise DataError(f"no validation document of {dataset} is longer than {prompt_bytes + 64} bytes")
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    doc = docs[i % len(docs)]
    lines = np.cumsum([0] + [len(l) for l in doc.splitlines(keepends=True)])
    starts = lines[lines < len(doc) - 2 * prompt_bytes] if len(doc) > 2 * prompt_bytes else [0]
    start = int(rng.choice(starts))
    raw = doc[start:].encode()[:prompt_bytes]
    out.append(raw.decode("utf-8", errors="ignore") or doc[:prompt_bytes])
  return out
