"""Text data: TFDS builders for the embedded corpora and local files, the grain
pipeline and prompt cutting; this package re-exports the public names.

Datasets (``DataConfig.name``): ``python_stdlib`` (the interpreter's stdlib
``.py`` files, tests and site-packages left out), ``python_docs``
(``pydoc_data`` help topics), ``text_files`` (``DataConfig.files`` glob
patterns: ``match_text_files``), or any prepared TFDS ``array_record``
dataset with a text feature (nothing is downloaded; missing: ``DataError``).
Embedded corpora build on first use under a file lock, one builder config
per interpreter (``interpreter_tag()``). Split: a document is in
``validation`` iff its salted name hash mod 10 000 < 500 (``split_for_name``).

Files: ``corpora.py`` (builders), ``sources.py``, ``pipeline.py`` (grain),
``prompts.py``, ``chat.py`` / ``chat_general.py`` / ``self_prompts.py`` /
``sharegpt.py`` (chat data), ``distilled.py`` (self-distilled datasets)."""

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
    chat_token_example, distilled_metadata, load_partial_batch, pack_partial, partial_run_dir,
    save_partial_batch, unpack_partial)
from mtp.data.pipeline import (
    JsonStateIterDataset, epoch_rows, make_eval_batches, make_train_dataset, pad_id_of)
from mtp.data.prompts import held_out_prompts, training_prompts
from mtp.data.sources import (
    ConcatSource, as_bytes, is_token_dataset, load_documents, load_source, mixture_names,
    named_documents, resolve_data_dir)
