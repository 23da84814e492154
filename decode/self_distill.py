r"""Self-distilled data: text sampled from a trained model with the project's
own decoder, written as a local TFDS dataset (``array_record``) that a
training stage reads like any other (``--config.data.name=NAME``).

    python -m decode.self_distill --workdir runs/tiny --out_name tiny_selfdistill \
        [--num_docs 512] [--prompt_bytes 128] [--max_new_tokens 256] [--temperature 1] \
        [--method mtp] [--batch_size 16] [--seed 0] [--data_dir DIR] [--out_dir DIR]

then e.g.

    python -m train --config configs/tiny.py --workdir runs/tiny_distill \
        --config.train.init_from=runs/tiny --config.train.freeze_backbone=true \
        --config.mtp.distill_weight=1 --config.data.name=tiny_selfdistill [--config.data.data_dir=OUT_DIR]

Why: a draft is kept when the main model would have produced it, so the
text a drafter should learn from is the main model's own (FastMTP, Cai et
al. 2025; Medusa-2; EAGLE), not the corpus.

Documents. Each one is ``prompt + continuation``: the prompt is a window of
``prompt_bytes`` bytes of a *training* document of the workdir's dataset
(``data.name``, split ``data.train_split``) that ends at a line boundary
chosen at random (the text before that boundary, its last ``prompt_bytes``
bytes, cut at a UTF-8 character boundary); the continuation is up to
``max_new_tokens`` tokens sampled from the model (``decode.speculative.Decoder``,
MTP speculative sampling by default: lossless, so the text follows the main
model at the given temperature / top-k / top-p exactly, only faster), ending
early at EOS. Documents are drawn in a seeded random order, cycling when
``num_docs`` exceeds the documents long enough to cut a prompt from.

Splits: ``train`` holds the generated documents; ``validation`` is a copy of
the source dataset's validation split (real held-out text, never trained
on), so a stage's validation metrics on this dataset are comparable with
those of a stage on the source dataset. Each dataset records its recipe
(workdir, step, sampling settings, seed, token counts, wall time) in the
TFDS metadata (``metadata.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import tempfile
import time

import numpy as np

from decode.speculative import METHODS, DecodeError, Decoder, SamplingParams
from mtp import checkpoint as ckpt_lib
from mtp import data as data_lib
from mtp import tokenizer as tok
from mtp.config import DataConfig

DATASET_VERSION = "1.0.0"


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How a self-distilled dataset is made (recorded in its metadata).

  num_docs >= 1 generated training documents; prompt_bytes >= 1 (bytes of
  real text before each continuation); max_new_tokens >= 1; temperature
  >= 0, top_k >= 0, top_p in (0, 1] (``SamplingParams``); method one of
  ``decode.speculative.METHODS`` except "draft"; num_draft_tokens >= 1
  (G, for "mtp"; 0 = the model's depth D); batch_size >= 1 rows decoded
  together; seed >= 0 (prompt choice and sampling).
  """
  num_docs: int = 512
  prompt_bytes: int = 128
  max_new_tokens: int = 256
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  method: str = "mtp"
  num_draft_tokens: int = 0
  batch_size: int = 16
  seed: int = 0

  def validate(self) -> "Recipe":
    """Returns self or raises DecodeError naming the flag and its range."""
    for name in ("num_docs", "prompt_bytes", "max_new_tokens", "batch_size"):
      v = getattr(self, name)
      if not (isinstance(v, int) and v >= 1):
        raise DecodeError(f"--{name}={v!r} must be an integer >= 1")
    if self.method not in ("ar", "mtp"):
      raise DecodeError(f"--method={self.method!r} must be 'ar' or 'mtp' (the model samples itself)")
    if not (isinstance(self.num_draft_tokens, int) and self.num_draft_tokens >= 0):
      raise DecodeError(f"--num_draft_tokens={self.num_draft_tokens!r} must be an integer >= 0 "
                        "(0 = the model's MTP depth D)")
    if not (isinstance(self.seed, int) and self.seed >= 0):
      raise DecodeError(f"--seed={self.seed!r} must be an integer >= 0")
    SamplingParams(self.temperature, self.top_k, self.top_p).validate()
    return self


def _as_bytes(value) -> bytes:
  """A TFDS text feature value (bytes, str or 0-d array) as UTF-8 bytes."""
  if isinstance(value, np.ndarray):
    value = value.item()
  return value.encode("utf-8") if isinstance(value, str) else bytes(value)


def training_prompts(data_cfg: DataConfig, n: int, prompt_bytes: int, seed: int = 0
                     ) -> list[tuple[str, str]]:
  """``n`` prompts ``(source_name, text)`` cut from training documents (module
  docstring): each the last ``prompt_bytes`` bytes (or fewer, at a UTF-8
  boundary) before a random line boundary at least 16 bytes into a document.
  Deterministic for a seed.

  Raises DataError (dataset or split missing, or no training document with a
  line boundary past its 16th byte).
  """
  src = data_lib.load_source(data_cfg, data_cfg.train_split)
  rng = np.random.default_rng(seed)
  order = rng.permutation(len(src))
  out, tried = [], 0
  while len(out) < n:
    if tried >= len(order) and not out:
      raise data_lib.DataError(f"no training document of '{data_cfg.name}' has a line boundary "
                               "past its 16th byte to cut a prompt at")
    rec = src[int(order[tried % len(order)])]
    tried += 1
    raw = _as_bytes(rec[data_cfg.text_feature])
    ends = np.flatnonzero(np.frombuffer(raw, np.uint8)[16:] == 0x0A) + 17    # just after a newline
    if not ends.size:
      continue
    end = int(rng.choice(ends))
    text = raw[max(0, end - prompt_bytes):end].decode("utf-8", errors="ignore")
    if not text:
      continue
    name = _as_bytes(rec["name"]).decode("utf-8", "replace") if "name" in rec else ""
    out.append((name or f"doc{int(order[(tried - 1) % len(order)])}", text))
  return out


def generate_documents(workdir: str, recipe: Recipe, *, data_dir: str = "", log=print
                       ) -> tuple[list[tuple[str, str]], dict]:
  """Samples ``recipe.num_docs`` documents from the model in ``workdir``.

  Returns (docs, stats): docs is a list of (key, text) with text = prompt +
  continuation (UTF-8 decoded, invalid bytes replaced); stats holds
  tokens_generated, eos_fraction, tau (tokens per target call),
  wall_s (seconds of decoding, compilation included) and the model's step.

  Raises CheckpointError, DataError, DecodeError.
  """
  recipe.validate()
  cfg, model, step = ckpt_lib.load_model(workdir)
  if recipe.method == "mtp" and cfg.mtp.depth < 1:
    raise DecodeError(f"--method=mtp needs a model with MTP modules; {workdir!r} has mtp.depth=0 "
                      "(use --method=ar)")
  data_cfg = dataclasses.replace(cfg.data, data_dir=data_dir or cfg.data.data_dir)
  prompts = training_prompts(data_cfg, recipe.num_docs, recipe.prompt_bytes, recipe.seed)
  g = recipe.num_draft_tokens or max(cfg.mtp.depth, 1)
  decoder = Decoder(model, recipe.method, g)
  sp = SamplingParams(recipe.temperature, recipe.top_k, recipe.top_p)
  tk = tok.ByteTokenizer()
  docs, n_tokens, n_eos, calls = [], 0, 0, 0
  t0 = time.perf_counter()
  for start in range(0, len(prompts), recipe.batch_size):
    chunk = prompts[start:start + recipe.batch_size]
    encoded = [tk.encode(text, add_bos=True) for _, text in chunk]
    gen = decoder.generate(encoded, recipe.max_new_tokens, sp, seed=recipe.seed * 1_000_003 + start)
    calls += int(gen.target_calls.sum())
    for j, ((name, text), ids) in enumerate(zip(chunk, gen.tokens)):
      ids = np.asarray(ids)
      eos = bool(ids.size and ids[-1] == tok.EOS_ID)
      ids = ids[ids < tok.NUM_BYTES]            # bytes only: EOS ends the document
      docs.append((f"{start + j:07d}:{name}", text + tk.decode(ids)))
      n_tokens += len(gen.tokens[j])
      n_eos += eos
    if log is not None:
      log(f"generated {len(docs)}/{len(prompts)} documents ({n_tokens:,} tokens, "
          f"{time.perf_counter() - t0:.0f} s)")
  wall = time.perf_counter() - t0
  stats = {"tokens_generated": n_tokens, "eos_fraction": n_eos / max(len(docs), 1),
           "tau": n_tokens / max(calls, 1), "wall_s": wall, "step": int(step),
           "dataset": cfg.data.name, "num_draft_tokens": g if recipe.method == "mtp" else 0}
  return docs, stats


def _builder_class(name: str):
  """A TFDS builder class named ``name`` that writes given documents."""
  import tensorflow_datasets as tfds

  class SelfDistilled(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = tfds.core.Version(DATASET_VERSION)
    RELEASE_NOTES = {DATASET_VERSION: "Text sampled from a trained model (decode.self_distill)."}

    # As mtp.data's embedded corpora: no checksums file to look up (nothing is downloaded).
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):
      return None

    def __init__(self, *, splits=None, metadata=None, **kwargs):
      self._splits, self._metadata = splits or {}, metadata or {}
      super().__init__(**kwargs)

    def _info(self):
      return tfds.core.DatasetInfo(
          builder=self, description=__doc__.split("\n\n")[0],
          features=tfds.features.FeaturesDict({"text": tfds.features.Text(),
                                               "name": tfds.features.Text()}),
          metadata=tfds.core.MetadataDict(**self._metadata))

    def _split_generators(self, dl_manager):
      del dl_manager
      return {split: self._generate_examples(docs) for split, docs in self._splits.items()}

    def _generate_examples(self, docs):
      for key, text in docs:
        yield key, {"text": text, "name": key}

  SelfDistilled.name = name
  return SelfDistilled


def write_dataset(name: str, data_dir: str, splits: dict[str, list[tuple[str, str]]],
                  metadata: dict) -> str:
  """Writes documents ``splits`` ({split: [(key, text), ...]}, keys unique per
  split) as TFDS dataset ``name`` version 1.0.0 in ``array_record`` format
  under ``data_dir``, with ``metadata`` (JSON-serialisable) in its
  metadata.json. Returns the dataset's version folder.

  Raises DataError when ``name`` is not a snake_case identifier, names an
  embedded corpus, or already exists in ``data_dir``.
  """
  import tensorflow_datasets as tfds
  check_dataset_name(name, data_dir)
  folder = os.path.join(data_dir, name)
  os.makedirs(data_dir, exist_ok=True)
  builder = _builder_class(name)(splits=splits, metadata=metadata, data_dir=data_dir,
                                 file_format="array_record")
  previous = getattr(tfds.core.utils.tqdm_utils, "_active", True)
  tfds.display_progress_bar(False)
  try:
    with tempfile.TemporaryDirectory(prefix="mtp_tfds_dl_") as dl_dir:
      builder.download_and_prepare(download_dir=dl_dir, file_format="array_record",
                                   download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  finally:
    tfds.display_progress_bar(previous)
  return os.path.join(folder, DATASET_VERSION)


def check_dataset_name(name: str, data_dir: str) -> None:
  """Raises DataError unless ``name`` is a snake_case identifier, not an
  embedded corpus, and not yet a dataset in ``data_dir``."""
  import re
  if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name in data_lib.EMBEDDED_DATASETS:
    raise data_lib.DataError(f"--out_name={name!r} must be a new snake_case dataset name "
                             f"([a-z][a-z0-9_]*, not one of {data_lib.EMBEDDED_DATASETS})")
  folder = os.path.join(data_dir, name)
  if os.path.exists(folder):
    raise data_lib.DataError(f"dataset '{name}' already exists in data_dir '{data_dir}' ({folder});"
                             " pick another --out_name or delete that folder")


def make_dataset(workdir: str, out_name: str, recipe: Recipe, *, data_dir: str = "",
                 out_dir: str = "", log=print) -> dict:
  """Generates and writes a self-distilled dataset (module docstring).

  Args:
    workdir: trained run directory (its latest checkpoint samples the text).
    out_name: new TFDS dataset name (snake_case).
    recipe: sampling and size settings.
    data_dir: TFDS data dir of the source corpus (the workdir's data.name;
      "" = the workdir config's data.data_dir, else $MTP_DATA_DIR, else
      ~/.cache/mtp/tensorflow_datasets).
    out_dir: TFDS data dir to write into ("" = ``data_dir``).
  Returns:
    the metadata written with the dataset (recipe, generation stats, paths).
  Raises:
    CheckpointError, DataError (bad name, existing dataset, missing source),
    DecodeError (bad recipe).
  """
  recipe.validate()
  ckpt = ckpt_lib.Checkpointer(workdir, read_only=True)
  try:
    cfg = ckpt.restore_config()
  finally:
    ckpt.close()
  src_dir = data_lib.resolve_data_dir(DataConfig(data_dir=data_dir or cfg.data.data_dir))
  out_dir = os.path.abspath(out_dir) if out_dir else src_dir
  check_dataset_name(out_name, out_dir)                   # before minutes of sampling
  source_cfg = dataclasses.replace(cfg.data, data_dir=src_dir)
  src = data_lib.load_source(source_cfg, cfg.data.eval_split)
  # the source's keys (document names where it has them): TFDS orders records by key, so the
  # copy is read in the source's order and a stage evaluates on the same batches
  validation = [(_as_bytes(src[i]["name"]).decode("utf-8", "replace") if "name" in src[i]
                 else f"{i:07d}", _as_bytes(src[i][cfg.data.text_feature]).decode("utf-8", "replace"))
                for i in range(len(src))]
  docs, stats = generate_documents(workdir, recipe, data_dir=src_dir, log=log)
  meta = {"generator": "decode.self_distill", "workdir": os.path.abspath(workdir),
          "recipe": dataclasses.asdict(recipe), **stats, "num_docs": len(docs),
          "validation": f"copy of {cfg.data.name}/{cfg.data.eval_split} ({len(validation)} documents)",
          "date": datetime.date.today().isoformat()}
  path = write_dataset(out_name, out_dir, {"train": docs, "validation": validation}, meta)
  return {**meta, "path": path, "data_dir": out_dir}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", required=True, help="trained run directory (the model that samples)")
  ap.add_argument("--out_name", required=True, help="new TFDS dataset name (snake_case)")
  ap.add_argument("--data_dir", default="", help="TFDS data dir of the source corpus (default: the "
                  "workdir's data.data_dir, else $MTP_DATA_DIR, else ~/.cache/mtp/tensorflow_datasets)")
  ap.add_argument("--out_dir", default="", help="TFDS data dir to write into (default: --data_dir)")
  d = Recipe()
  ap.add_argument("--num_docs", type=int, default=d.num_docs, help="generated documents")
  ap.add_argument("--prompt_bytes", type=int, default=d.prompt_bytes,
                  help="bytes of real training text before each continuation")
  ap.add_argument("--max_new_tokens", type=int, default=d.max_new_tokens, help="tokens per continuation")
  ap.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature")
  ap.add_argument("--top_k", type=int, default=d.top_k, help="top-k (0 = off)")
  ap.add_argument("--top_p", type=float, default=d.top_p, help="top-p (1 = off)")
  ap.add_argument("--method", default=d.method, choices=[m for m in METHODS if m != "draft"],
                  help="decoder (both sample the main model exactly; mtp is faster)")
  ap.add_argument("--num_draft_tokens", type=int, default=d.num_draft_tokens,
                  help="G for --method=mtp (0 = the model's depth D)")
  ap.add_argument("--batch_size", type=int, default=d.batch_size, help="rows decoded together")
  ap.add_argument("--seed", type=int, default=d.seed, help="prompt choice and sampling seed")
  args = ap.parse_args(argv)
  recipe = Recipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe)})
  log = lambda s: print(s, file=sys.stderr, flush=True)
  try:
    meta = make_dataset(args.workdir, args.out_name, recipe, data_dir=args.data_dir,
                        out_dir=args.out_dir, log=log)
  except (DecodeError, ckpt_lib.CheckpointError, data_lib.DataError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {meta['num_docs']} documents ({meta['tokens_generated']:,} generated tokens, "
        f"tau {meta['tau']:.2f}, {meta['wall_s']:.0f} s) to {meta['path']}; train on it with "
        f"--config.data.name={args.out_name} --config.data.data_dir={meta['data_dir']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
