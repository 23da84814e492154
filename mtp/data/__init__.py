"""Text data: TFDS builders for the embedded corpora and local files, the grain
pipeline and prompt cutting.

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
  matched by a pattern are ignored. ``**`` does not enter symlinked folders
  (as ``find``), so a link back into the tree (``self -> .``, ``up -> ..``)
  neither repeats files nor loops; a symlinked folder is read where a pattern
  spells it (``src/**/*.py,src/vendor/**/*.py``) or reaches it with ``*``.
  Symlinked files are read through. A file reached by several paths
  (overlapping patterns, symlinks, hard links) is read once, named after a
  path with no symlink below the pattern's folder when a pattern matches
  one. Files that are not valid UTF-8 (binaries, Latin-1 text), empty or
  whitespace-only files, and files whose bytes repeat an earlier usable file
  (so the same text is never in both splits) are skipped, with their count
  and the first names in a warning (a broad pattern such as ``src/**/*``
  commonly catches images or ``.pyc`` files: stopping at each would force
  listing extensions); a ``DataError`` names the field and the pattern or file when
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

The grain pipeline (tokenizing, packing, batches, iterator state) is
described in ``mtp.data.pipeline``.

Files by job: ``corpora.py`` (the TFDS builders: embedded corpora, local
files and their globbing, self-distilled text and token datasets), ``sources.py`` (the
data dir; a dataset split as records or text), ``pipeline.py`` (grain),
``prompts.py`` (prompts cut from documents), ``chat.py`` (chat prompts: built
from the corpora for training, the hand-written held-out set, their overlap
check), ``distilled.py`` (self-distilled datasets around their writing: an
existing one's metadata, a partial run's folder and batches, token examples). This package re-exports their
public names, so ``from mtp import data`` is all a caller needs.
"""

from mtp.data.corpora import (
    DATA_DIR_ENV, DEFAULT_DATA_DIR, EMBEDDED_DATASETS, SELF_DISTILLED_VERSION, TEXT_FILES,
    TRAIN_SPLIT, VALIDATION_PER_10K, VALIDATION_SPLIT, DataError, PythonDocs, PythonStdlib,
    TextFile, TextFiles, check_dataset_name, docs_documents, interpreter_tag, match_text_files,
    prepare_embedded, prepare_text_files, read_text_files, split_for_name, stdlib_documents,
    text_files_fingerprint, text_files_splits, write_dataset, write_token_dataset)
from mtp.data.chat import (
    CATEGORIES as CHAT_CATEGORIES, HELDOUT_CATEGORIES, HELDOUT_CHAT_PATH, chat_prompts,
    heldout_chat_prompts, overlaps, prompt_messages, prompt_text, read_prompt_jsonl)
from mtp.data.distilled import (
    chat_token_example, distilled_metadata, load_partial_batch, partial_run_dir, save_partial_batch)
from mtp.data.pipeline import (
    JsonStateIterDataset, epoch_rows, make_eval_batches, make_train_dataset, pad_id_of)
from mtp.data.prompts import held_out_prompts, training_prompts
from mtp.data.sources import (
    ConcatSource, as_bytes, is_token_dataset, load_documents, load_source, mixture_names,
    named_documents, resolve_data_dir)
