"""The TFDS builders: the embedded corpora (``python_stdlib``, ``python_docs``),
local files (``text_files``, with their globbing and fingerprint) and
self-distilled datasets (``write_dataset``). What each corpus holds, how
documents are split and where builds live: the ``mtp.data`` package
docstring.
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
import re
import stat
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from absl import logging
from tensorflow_datasets.core import registered as tfds_registered

from mtp import quiet

EMBEDDED_DATASETS = ("python_stdlib", "python_docs")
TEXT_FILES = "text_files"
TRAIN_SPLIT = "train"
VALIDATION_SPLIT = "validation"
VALIDATION_PER_10K = 500          # 5% of documents go to validation
DEFAULT_DATA_DIR = os.path.join("~", ".cache", "mtp", "tensorflow_datasets")
DATA_DIR_ENV = "MTP_DATA_DIR"
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests",
                               "idle_test"})


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


def _build_once(make: Callable[[], tfds.core.DatasetBuilder],
                lock_path: str) -> tfds.core.DatasetBuilder:
  """The builder made by ``make`` once its dataset is prepared, building it
  first (under an exclusive lock on ``lock_path``) unless present.

  A builder reads ``dataset_info.json`` when it is made, so one made before
  another process finished the build reports the dataset prepared but knows
  no splits; such a builder is made again. Inside the lock the re-check
  is made after any other builder has finished (TFDS writes into a temporary
  folder and renames it).
  """
  builder = make()
  if _is_prepared(builder):
    return builder if builder.info.splits else make()
  os.makedirs(os.path.dirname(lock_path), exist_ok=True)
  with _file_lock(lock_path):
    builder = make()
    if not _is_prepared(builder):
      with tempfile.TemporaryDirectory(prefix="mtp_tfds_dl_") as dl_dir, _quiet_tfds():
        builder.download_and_prepare(
            download_dir=dl_dir, file_format="array_record",
            download_config=tfds.download.DownloadConfig(try_download_gcs=False))
      builder = make()
  return builder


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
  try:
    return _build_once(
        lambda: cls(data_dir=data_dir, config=config, file_format="array_record"),
        os.path.join(data_dir, f".{name}-{config}.lock"))
  except DataError:
    raise
  except Exception as e:  # noqa: BLE001 - report any build failure uniformly
    raise DataError(f"building embedded dataset '{name}' (config {config}) in data_dir "
                    f"'{data_dir}' failed: {type(e).__name__}: {e}") from e


# ----------------------------------------------------------------------------
# Local files (data.name = "text_files")
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TextFile:
  """One file matched by ``DataConfig.files``.

  name: path relative to its pattern's folder part, ``/`` separators (the
    document name that decides the split); path: real absolute path
    (symlinks resolved); size: bytes; mtime_ns: modification time (ns since
    the epoch).
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


def _walk_folders(top: str) -> Iterator[str]:
  """``top`` and every folder below it, as ``glob``'s ``**`` lists them
  (names starting with ``.`` skipped), except that symlinked folders are not
  entered (as ``find`` and ``os.walk``): a link back into the tree then can
  neither repeat its files nor make the walk loop. ``""`` stands for the
  working directory, and the folders below it stay relative."""
  stack = [top]
  while stack:
    folder = stack.pop()
    yield folder
    try:
      with os.scandir(folder or os.curdir) as entries:
        subs = [e.name for e in entries
                if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
    except OSError:
      continue
    stack.extend(os.path.join(folder, n) for n in sorted(subs, reverse=True))


def _glob(pattern: str) -> set[str]:
  """``glob.glob(pattern, recursive=True)``, except that ``**`` does not
  enter symlinked folders (``_walk_folders``). A symlinked folder spelled in
  the pattern, or matched by a component other than ``**`` (e.g. ``*``), is
  entered: a pattern without ``**`` reaches a bounded depth, so it cannot
  loop."""
  parts = pattern.split(os.sep)
  if "**" not in parts:
    return set(glob.glob(pattern))
  i = parts.index("**")
  head = os.sep.join(parts[:i]) or (os.sep if i else "")
  last = i == len(parts) - 1
  rest = "*" if last else os.sep.join(parts[i + 1:])
  tops = [t for t in glob.glob(head) if os.path.isdir(t)] if head else [""]
  out = set()
  for top in tops:
    if top and last:
      out.add(os.path.join(top, ""))      # as glob: "src/**" lists "src/" and all below
    for folder in _walk_folders(top):
      out.update(_glob(os.path.join(glob.escape(folder), rest)))
  return out


def match_text_files(files: str) -> list[TextFile]:
  """The files matched by ``files`` (``DataConfig.files``: comma-separated
  globs, ``**`` recursive, ``~`` expanded), sorted by path; folders ignored.
  ``**`` does not enter symlinked folders (no loops or repeats; a pattern may
  spell one); symlinked files are read through. Each file is listed once by
  ``(st_dev, st_ino)``, named after a match with no symlink below the
  pattern's folder when there is one, else its first match, so a document
  never changes split. Raises DataError: an empty pattern, one matching no
  file, or a matched path that cannot be stat'ed or is not a regular file."""
  patterns = [p.strip() for p in files.split(",")]
  if not files.strip() or not all(patterns):
    raise DataError(f"data.files={files!r} must be a comma-separated list of non-empty glob "
                    "patterns, e.g. 'src/**/*.py,docs/*.md'")
  found: dict[tuple[int, int], tuple[bool, TextFile]] = {}   # (dev, ino): (direct, file)
  for pattern in patterns:
    expanded = os.path.expanduser(pattern)
    folder = os.path.abspath(_pattern_folder(expanded))
    real_folder = os.path.realpath(folder)
    n_files = n_dirs = 0
    for match in sorted(_glob(expanded)):
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
      rel = os.path.relpath(path, folder)
      real = os.path.realpath(path)
      direct = real == os.path.join(real_folder, rel)
      key = (st.st_dev, st.st_ino)
      if key not in found or (direct and not found[key][0]):
        found[key] = (direct, TextFile(rel.replace(os.sep, "/"), real, int(st.st_size),
                                       int(st.st_mtime_ns)))
    if not n_files:
      hint = (f"; it matches {n_dirs} folder(s) only: use '{pattern.rstrip('/')}/**/*' for the "
              "files below" if n_dirs else "")
      raise DataError(f"data.files pattern {pattern!r} matches no file (relative to "
                      f"{os.getcwd()!r}; names starting with '.' need a pattern that spells the "
                      f"dot){hint}")
  return sorted((f for _, f in found.values()), key=lambda f: f.path)


def text_files_fingerprint(files: list[TextFile]) -> str:
  """16 hex digits of sha256 over every file's (name, path, size, mtime_ns):
  any change to the set of files, a name, a size or a modification time
  gives a new fingerprint (and so a new build). The salt's version names the
  rules that pick and deduplicate the files (``v2``: once per file identity
  and per content, ``match_text_files`` and ``read_text_files``), so a build
  made under other rules is never reused."""
  blob = json.dumps([[f.name, f.path, f.size, f.mtime_ns] for f in files], ensure_ascii=False)
  return hashlib.sha256(f"{TEXT_FILES}/v2\n{blob}".encode("utf-8", "surrogatepass")).hexdigest()[:16]


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
  """Reads and decodes ``files``. Files that are not valid UTF-8, empty or
  whitespace-only files, and files whose bytes repeat an earlier usable file
  (a copy at another path: kept, it could land in the other split and be
  both trained on and validated on) are skipped (not an error; see the
  module docstring).

  Returns:
    (documents, skipped): documents is a list of (file, text) for the usable
    files in input order; skipped is ``{"not_utf8": [(name, byte_offset)],
    "empty": [name], "duplicate": [(name, name of the earlier file)]}``.

  Raises:
    DataError: a file cannot be read (names the file and the OS error).
  """
  docs, not_utf8, empty, duplicate = [], [], [], []
  first_with: dict[bytes, str] = {}     # sha256 of a usable file's bytes: its name
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
    digest = hashlib.sha256(raw).digest()
    if digest in first_with:
      duplicate.append((f.name, first_with[digest]))
      continue
    first_with[digest] = f.name
    docs.append((f, text))
  return docs, {"not_utf8": not_utf8, "empty": empty, "duplicate": duplicate}


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
    if skipped["duplicate"]:
      logging.warning("text_files: skipped %d files identical to an earlier one: %s%s",
                      len(skipped["duplicate"]),
                      ", ".join(f"{name!r} (same as {first!r})"
                                for name, first in skipped["duplicate"][:3]),
                      ", ..." if len(skipped["duplicate"]) > 3 else "")
    if len(docs) < 2:
      detail = ""
      if skipped["not_utf8"]:
        detail += (f"; {len(skipped['not_utf8'])} not valid UTF-8 (first: "
                   f"{skipped['not_utf8'][0][0]!r} at byte {skipped['not_utf8'][0][1]})")
      if skipped["empty"]:
        detail += f"; {len(skipped['empty'])} empty"
      if skipped["duplicate"]:
        detail += f"; {len(skipped['duplicate'])} identical to an earlier file"
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
  try:
    return _build_once(make, os.path.join(data_dir, f".{TEXT_FILES}-{config.name}.lock"))
  except DataError:
    raise
  except Exception as e:  # noqa: BLE001 - report any build failure uniformly
    raise DataError(f"building the text_files dataset of data.files={files!r} in data_dir "
                    f"'{data_dir}' failed: {type(e).__name__}: {e}") from e


# ----------------------------------------------------------------------------
# Self-distilled datasets (written by scripts.self_distill)
# ----------------------------------------------------------------------------

SELF_DISTILLED_VERSION = "1.0.0"
# The description stored in a self-distilled dataset's dataset_info.json.
_SELF_DISTILLED_DESCRIPTION = (
    "Self-distilled data: text sampled from a trained model with the project's\n"
    "own decoder, written as a local TFDS dataset (``array_record``) that a\n"
    "training stage reads like any other (``--config.data.name=NAME``).")


class _GivenSplitsBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A TFDS builder that writes the examples it is given: ``splits`` =
  {split: [(key, example), ...]}, ``metadata`` stored in metadata.json.
  Subclasses set VERSION, RELEASE_NOTES, ``_info`` and ``_example``."""

  # As the embedded corpora: no checksums file to look up (nothing is downloaded).
  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls):
    return None

  def __init__(self, *, splits=None, metadata=None, **kwargs):
    self._splits, self._metadata = splits or {}, metadata or {}
    super().__init__(**kwargs)

  def _split_generators(self, dl_manager):
    del dl_manager
    return {split: self._generate_examples(items) for split, items in self._splits.items()}

  def _generate_examples(self, items):
    for key, example in items:
      yield key, self._example(key, example)


def _self_distilled_builder(name: str):
  """A TFDS builder class named ``name`` that writes given documents."""

  class SelfDistilled(_GivenSplitsBuilder, skip_registration=True):
    VERSION = tfds.core.Version(SELF_DISTILLED_VERSION)
    RELEASE_NOTES = {SELF_DISTILLED_VERSION: "Text sampled from a trained model (scripts.self_distill)."}

    def _info(self):
      return tfds.core.DatasetInfo(
          builder=self, description=_SELF_DISTILLED_DESCRIPTION,
          features=tfds.features.FeaturesDict({"text": tfds.features.Text(),
                                               "name": tfds.features.Text()}),
          metadata=tfds.core.MetadataDict(**self._metadata))

    def _example(self, key, text):
      return {"text": text, "name": key}

  SelfDistilled.name = name
  return SelfDistilled


# Features of a token dataset (write_token_dataset): what the model saw and emitted.
TOKEN_FEATURES = ("tokens", "loss_mask", "category", "name")
# The description stored in a token dataset's dataset_info.json.
_TOKEN_DATASET_DESCRIPTION = (
    "Token dataset (scripts.self_distill --chat_prompts): per example the token ids a model\n"
    "saw and emitted (tokens int32 [n]: chat prompt + answer), loss_mask int32 [n] (1 on\n"
    "answer tokens, 0 on prompt/template tokens), the prompt's category and a key (name).")


def _token_dataset_builder(name: str):
  """A TFDS builder class named ``name`` that writes given token examples."""

  class TokenDataset(_SaysWhatItBuilds, _GivenSplitsBuilder, skip_registration=True):
    VERSION = tfds.core.Version(SELF_DISTILLED_VERSION)
    RELEASE_NOTES = {SELF_DISTILLED_VERSION: "Token ids sampled from a model (scripts.self_distill)."}

    def _source(self):
      return f"{sum(len(r) for r in self._splits.values())} token examples"

    def _info(self):
      return tfds.core.DatasetInfo(
          builder=self, description=_TOKEN_DATASET_DESCRIPTION,
          features=tfds.features.FeaturesDict({
              "tokens": tfds.features.Tensor(shape=(None,), dtype=np.int32),
              "loss_mask": tfds.features.Tensor(shape=(None,), dtype=np.int32),
              "category": tfds.features.Text(), "name": tfds.features.Text()}),
          metadata=tfds.core.MetadataDict(**self._metadata))

    def _example(self, key, ex):
      return {"tokens": np.asarray(ex["tokens"], np.int32),
              "loss_mask": np.asarray(ex["loss_mask"], np.int32),
              "category": ex.get("category", ""), "name": key}

  TokenDataset.name = name
  return TokenDataset


def write_token_dataset(name: str, data_dir: str, splits: dict[str, list[tuple[str, dict]]],
                        metadata: dict) -> str:
  """Writes token examples as TFDS dataset ``name`` 1.0.0 (``array_record``)
  under ``data_dir`` with ``metadata`` in its metadata.json; returns the
  version folder. splits: ``{split: [(key, {"tokens": int32 [n], "loss_mask":
  int32 [n] (0/1), "category": str}), ...]}``, keys unique per split (TFDS
  orders by key). Read back: tokens, loss_mask, category and name (bytes).
  Raises DataError: a bad or existing name, or an example whose arrays differ
  in length, are not 1-D or hold a mask value other than 0 and 1."""
  check_dataset_name(name, data_dir)
  for split, rows in splits.items():
    for key, ex in rows:
      t, m = np.asarray(ex["tokens"]), np.asarray(ex["loss_mask"])
      if t.ndim != 1 or t.shape != m.shape:
        raise DataError(f"{split}/{key}: tokens {t.shape} and loss_mask {m.shape} must be 1-D "
                        "of the same length")
      if m.size and not np.isin(m, (0, 1)).all():
        raise DataError(f"{split}/{key}: loss_mask must hold only 0 and 1")
  os.makedirs(data_dir, exist_ok=True)
  builder = _token_dataset_builder(name)(splits=splits, metadata=metadata, data_dir=data_dir,
                                         file_format="array_record")
  with tempfile.TemporaryDirectory(prefix="mtp_tfds_dl_") as dl_dir, _quiet_tfds():
    builder.download_and_prepare(download_dir=dl_dir, file_format="array_record",
                                 download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return os.path.join(data_dir, name, SELF_DISTILLED_VERSION)


def check_dataset_name(name: str, data_dir: str) -> None:
  """Raises DataError unless ``name`` is a snake_case identifier, not an
  embedded corpus, and not yet a dataset in ``data_dir``."""
  if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name in EMBEDDED_DATASETS:
    raise DataError(f"--out_name={name!r} must be a new snake_case dataset name "
                    f"([a-z][a-z0-9_]*, not one of {EMBEDDED_DATASETS})")
  folder = os.path.join(data_dir, name)
  if os.path.exists(folder):
    raise DataError(f"dataset '{name}' already exists in data_dir '{data_dir}' ({folder});"
                    " pick another --out_name or delete that folder")


def write_dataset(name: str, data_dir: str, splits: dict[str, list[tuple[str, str]]],
                  metadata: dict) -> str:
  """Writes documents ``splits`` ({split: [(key, text), ...]}, keys unique per
  split) as TFDS dataset ``name`` version 1.0.0 in ``array_record`` format
  under ``data_dir``, with ``metadata`` (JSON-serialisable) in its
  metadata.json. Returns the dataset's version folder. It reads like any
  other prepared dataset (``--config.data.name=NAME``).

  Raises DataError when ``name`` is not a snake_case identifier, names an
  embedded corpus, or already exists in ``data_dir``.
  """
  check_dataset_name(name, data_dir)
  folder = os.path.join(data_dir, name)
  os.makedirs(data_dir, exist_ok=True)
  builder = _self_distilled_builder(name)(splits=splits, metadata=metadata, data_dir=data_dir,
                                          file_format="array_record")
  with tempfile.TemporaryDirectory(prefix="mtp_tfds_dl_") as dl_dir, _quiet_tfds():
    builder.download_and_prepare(download_dir=dl_dir, file_format="array_record",
                                 download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return os.path.join(folder, SELF_DISTILLED_VERSION)
