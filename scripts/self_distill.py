r"""Self-distilled data: text sampled from a trained model with the project's
own decoder, written as a local TFDS dataset (``array_record``) that a
training stage reads like any other (``--config.data.name=NAME``).

    python -m scripts.self_distill --workdir runs/tiny --out_name tiny_selfdistill \
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
``max_new_tokens`` tokens sampled from the model (``decode.decoder.Decoder``,
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

This module does the generation only; the prompts are cut by
``mtp.data.training_prompts`` and the dataset is written by
``mtp.data.write_dataset`` (``mtp/data/corpora.py``).

Chat mode (``--chat_prompts N``, an instruct target with a chat template,
e.g. an imported SmolLM2 workdir):

    python -m scripts.self_distill --workdir runs/smollm --out_name smollm_chat \
        --chat_prompts 2048 --temperatures 0,1 [--val_prompts 128] [--method ar] \
        [--batch_size 32] [--max_new_tokens 256] [--max_context_chars 1200] \
        [--self_prompts runs/self_prompts.jsonl --self_prompt_share 0.5]

builds N training chat prompts from the embedded corpora
(``mtp.data.chat_prompts``, split ``train``; categories code, explain, qa,
summarise, rewrite, docstring, tests), renders each with the workdir
tokenizer's chat template (generation prompt appended), and samples the
model's answer with ``decode.decoder.Decoder`` (the tokenizer's stop
ids, the end-of-turn token among them, end a row). Prompt i is sampled at
``temperatures[i % len(temperatures)]``. The dataset holds TOKEN IDS, not
text (``mtp.data.write_token_dataset``): per example ``tokens`` int32 [n] =
the prompt's ids followed by the answer's ids, exactly what the model saw
and emitted, and ``loss_mask`` int32 [n] = 0 on the prompt (template
included) and 1 on the answer (its final end-of-turn token included when
emitted), plus ``category`` and ``name`` (``"IIIIIII:CATEGORY:T<temp>"``, I
the prompt index). Split ``validation`` holds answers to ``--val_prompts``
prompts built the same way from the corpora's *validation* documents (not
the held-out evaluation set, ``mtp/data/heldout_chat.jsonl``). Prompts
longer than ``max_seq_len - max_new_tokens`` tokens are skipped (counted
in the metadata). The metadata records the workdir, recipe, seed, counts,
wall time and peak memory. An interrupted run resumes: every finished batch
is kept in ``OUT_DIR/.OUT_NAME.partial/`` and re-running with the same
arguments decodes only the rest (the same results: batches and seeds are
deterministic); the folder is removed once the dataset is written.
``--carry FILE`` keeps a packed copy of that folder (one compressed
``.npz``, ``mtp.data.pack_partial``) rewritten after every batch and
restored before the build starts, so a build can be committed part-done
and resumed in another checkout.
Re-running with the same arguments when the dataset exists does nothing (it
says so); other arguments with an existing name (or partial run) are refused.
The data pipeline packs such a dataset as is and carries ``loss_mask``
(``mtp.data.pipeline``; read it with the model's tokenizer).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import re
import resource
import shutil
import sys
import time

from mtp import cli


def snapshot_error(snapshot: str, out_name: str, chat_prompts: int | None) -> str | None:
  """Why ``--snapshot`` cannot be taken (None: it can): it needs chat mode,
  a snake_case name, and a name other than the build's."""
  if not snapshot:
    return None
  if not chat_prompts:
    return "--snapshot: needs chat mode (the build's --chat_prompts N and its other arguments)"
  if snapshot == out_name:
    return (f"--snapshot={snapshot!r} must differ from --out_name (the build's own name, "
            "which the build writes when it finishes)")
  if not re.fullmatch(r"[a-z][a-z0-9_]*", snapshot):
    return f"--snapshot={snapshot!r} must be a new snake_case dataset name ([a-z][a-z0-9_]*)"
  return None


if __name__ == "__main__":     # a flag out of range: one line, before the imports below load jax
  _early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
  for _flag in ("--snapshot", "--out_name"):
    _early.add_argument(_flag, default="")
  _early.add_argument("--chat_prompts", type=int, default=0)
  _known, _ = _early.parse_known_args()
  _why = snapshot_error(_known.snapshot, _known.out_name, _known.chat_prompts)
  if _why:
    print(f"error: {_why}", file=sys.stderr)
    sys.exit(2)
  cli.refuse_bad_flags(num_docs=(int, 1), prompt_bytes=(int, 1), max_new_tokens=(int, 1),
                       temperature=(float, 0), top_k=(int, 0), top_p=(float, 0, 1, True),
                       num_draft_tokens=(int, 0), batch_size=(int, 1), seed=(int, 0),
                       chat_prompts=(int, 0), val_prompts=(int, 0), max_context_chars=(int, 200),
                       self_prompt_share=(float, 0, 1))

import numpy as np  # noqa: E402

from decode.decoder import METHODS, DecodeError, Decoder, SamplingParams  # noqa: E402
from mtp import checkpoint as ckpt_lib  # noqa: E402
from mtp import data as data_lib  # noqa: E402
from mtp import loading  # noqa: E402
from mtp import tokenizer as tok  # noqa: E402
from mtp.config import DataConfig  # noqa: E402
from mtp.data import self_prompts as self_prompts_lib  # noqa: E402


# -- text mode -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Recipe:
  """How a self-distilled dataset is made (recorded in its metadata).

  num_docs >= 1 generated training documents; prompt_bytes >= 1 (bytes of
  real text before each continuation); max_new_tokens >= 1; temperature
  >= 0, top_k >= 0, top_p in (0, 1] (``SamplingParams``); method one of
  ``decode.decoder.METHODS`` except "draft"; num_draft_tokens >= 1
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
  cfg, model, step = loading.load_model(workdir)
  if recipe.method == "mtp" and cfg.mtp.depth < 1:
    raise DecodeError(f"--method=mtp needs a model with MTP modules; {workdir!r} has mtp.depth=0 "
                      "(use --method=ar)")
  data_cfg = dataclasses.replace(cfg.data, data_dir=data_dir or cfg.data.data_dir)
  prompts = data_lib.training_prompts(data_cfg, recipe.num_docs, recipe.prompt_bytes, recipe.seed)
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
  cfg, _ = loading.load_config(workdir)
  src_dir = data_lib.resolve_data_dir(DataConfig(data_dir=data_dir or cfg.data.data_dir))
  out_dir = os.path.abspath(out_dir) if out_dir else src_dir
  data_lib.check_dataset_name(out_name, out_dir)          # before minutes of sampling
  source_cfg = dataclasses.replace(cfg.data, data_dir=src_dir)
  # the source's keys (document names where it has them): TFDS orders records by key, so the
  # copy is read in the source's order and a stage evaluates on the same batches
  validation = data_lib.named_documents(source_cfg, cfg.data.eval_split)
  docs, stats = generate_documents(workdir, recipe, data_dir=src_dir, log=log)
  meta = {"generator": "scripts.self_distill", "workdir": os.path.abspath(workdir),
          "recipe": dataclasses.asdict(recipe), **stats, "num_docs": len(docs),
          "validation": f"copy of {cfg.data.name}/{cfg.data.eval_split} ({len(validation)} documents)",
          "date": datetime.date.today().isoformat()}
  path = data_lib.write_dataset(out_name, out_dir, {"train": docs, "validation": validation}, meta)
  return {**meta, "path": path, "data_dir": out_dir}


# -- chat mode (--chat_prompts) ------------------------------------------------------------
#
# Chat mode (``--chat_prompts N``; the module docstring describes the
# dataset): chat prompts built from the embedded corpora (``mtp.data.chat_prompts``),
# rendered with the workdir tokenizer's chat template and answered by the
# model with ``decode.decoder.Decoder``; the answers are written as a
# token dataset (``mtp.data.write_token_dataset``). An interrupted run
# resumes from the finished batches in its partial folder
# (``mtp.data.partial_run_dir``).

@dataclasses.dataclass(frozen=True)
class ChatRecipe:
  """How a self-distilled chat token dataset is made (recorded in its metadata).

  chat_prompts >= 1 training prompts; val_prompts >= 0 validation prompts;
  temperatures: non-empty tuple of temperatures >= 0 (prompt i uses
  ``temperatures[i % len]``); top_k >= 0, top_p in (0, 1]; max_new_tokens
  >= 1; method "ar" or "mtp"; num_draft_tokens >= 0 (0 = D); batch_size >= 1;
  seed >= 0; max_context_chars >= 200 (``mtp.data.chat_prompts``);
  categories: a non-empty subset of ``mtp.data.CHAT_CATEGORIES``;
  self_prompts: a self-written prompt file (``scripts/self_prompts.py``,
  JSONL) and self_prompt_share in [0, 1]: that share of the *training*
  prompts comes from the file (``mix_prompt_sources``: the file's first
  round(share * chat_prompts) prompts, the rest templated, shuffled by seed);
  validation stays templated, so agreement stays comparable across recipes.
  """
  chat_prompts: int = 512
  val_prompts: int = 32
  temperatures: tuple[float, ...] = (0.0, 1.0)
  top_k: int = 0
  top_p: float = 1.0
  max_new_tokens: int = 256
  method: str = "ar"
  num_draft_tokens: int = 0
  batch_size: int = 32
  seed: int = 0
  max_context_chars: int = data_lib.chat.MAX_CONTEXT_CHARS
  categories: tuple[str, ...] = data_lib.CHAT_CATEGORIES
  self_prompts: str = ""
  self_prompt_share: float = 0.0

  def validate(self) -> "ChatRecipe":
    """Returns self or raises DecodeError naming the flag and its range."""
    for name, lo in (("chat_prompts", 1), ("val_prompts", 0), ("max_new_tokens", 1),
                     ("batch_size", 1), ("seed", 0), ("num_draft_tokens", 0),
                     ("max_context_chars", 200)):
      v = getattr(self, name)
      if not (isinstance(v, int) and not isinstance(v, bool) and v >= lo):
        raise DecodeError(f"--{name}={v!r} must be an integer >= {lo}")
    if self.method not in ("ar", "mtp"):
      raise DecodeError(f"--method={self.method!r} must be 'ar' or 'mtp' (the model samples itself)")
    if not self.temperatures:
      raise DecodeError("--temperatures must list at least one temperature >= 0")
    for t in self.temperatures:
      SamplingParams(t, self.top_k, self.top_p).validate()
    share = self.self_prompt_share
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
      raise DecodeError(f"--self_prompt_share={share!r} must be a number in [0, 1]")
    if share > 0 and not self.self_prompts:
      raise DecodeError(f"--self_prompt_share={share} needs --self_prompts FILE (a self-written "
                        "prompt file: python -m scripts.self_prompts)")
    bad = [c for c in self.categories if c not in data_lib.CHAT_CATEGORIES]
    if not self.categories or bad:
      raise DecodeError(f"--categories={','.join(self.categories)!r}: each must be one of "
                        f"{','.join(data_lib.CHAT_CATEGORIES)}")
    return self


_SELF_PROMPT_FIELDS = ("self_prompts", "self_prompt_share")


def chat_recipe_json(recipe: ChatRecipe) -> dict:
  """The recipe as recorded in (and compared with) a dataset's metadata.
  The self-written prompt fields appear only when used, so a dataset made
  before they existed still matches its own recipe (a re-run does nothing)."""
  out = json.loads(json.dumps(dataclasses.asdict(recipe)))
  if not recipe.self_prompt_share:
    for k in _SELF_PROMPT_FIELDS:
      out.pop(k)
    return out
  try:                      # the file's content is part of the recipe, not only its path
    with open(recipe.self_prompts, "rb") as f:
      out["self_prompts_sha256"] = hashlib.sha256(f.read()).hexdigest()
  except OSError as e:
    raise data_lib.DataError(f"--self_prompts={recipe.self_prompts!r}: cannot read it "
                             f"({e.strerror})") from None
  return out


def training_chat_prompts(recipe: ChatRecipe, n: int, split: str, kw: dict) -> list[dict]:
  """The ``n`` chat prompts of ``split``: templated (``mtp.data.chat_prompts``),
  with ``recipe.self_prompt_share`` of the training split from the
  self-written prompt file (``mix_prompt_sources``). Raises DataError (an
  unreadable file, or fewer prompts in it than the share needs)."""
  if split != "train" or not recipe.self_prompt_share:
    return data_lib.chat_prompts(n, split=split, **kw)
  share = float(recipe.self_prompt_share)
  weights = {"templated": 1.0 - share, "self_written": share}
  # only the templated prompts the mix takes (a list of n extends a shorter one): at share 1, none
  need = self_prompts_lib.mix_counts(list(weights), weights, n)["templated"]
  templated = data_lib.chat_prompts(need, split=split, **kw) if need else []
  return self_prompts_lib.mix_prompt_sources(
      {"templated": templated, "self_written": self_prompts_lib.read_self_prompts(recipe.self_prompts)},
      weights, n, seed=recipe.seed)


def parse_temperatures(text: str) -> tuple[float, ...]:
  """``--temperatures`` "0,1" -> (0.0, 1.0). Raises DecodeError for an entry
  that is not a number >= 0 or an empty list."""
  out = []
  for part in str(text).split(","):
    try:
      t = float(part.strip())
    except ValueError:
      raise DecodeError(f"--temperatures={text!r}: {part.strip()!r} is not a number "
                        "(give comma-separated temperatures >= 0, e.g. 0,1)") from None
    if not t >= 0:
      raise DecodeError(f"--temperatures={text!r}: {t} must be >= 0")
    out.append(t)
  if not out:
    raise DecodeError("--temperatures must list at least one temperature >= 0")
  return tuple(out)


def answer_examples(decoder: Decoder, prompts: list[dict], recipe: ChatRecipe, *,
                    max_prompt_tokens: int, seed_offset: int = 0, log=None,
                    cache_dir: str | None = None, cache_tag: str = "train",
                    only_cached: bool = False, on_batch=None) -> tuple[list[tuple[str, dict]], dict]:
  """Samples the model's answer to each chat prompt (``{"category",
  "messages"}``) and returns token examples and counts.

  Prompt i is rendered with ``decoder.tokenizer.apply_chat_template(messages,
  add_generation_prompt=True)`` (ids ``p`` int32 [P]) and answered at
  ``recipe.temperatures[i % len]``; rows of one temperature are decoded in
  batches of ``recipe.batch_size`` (sorted by prompt length; the last batch
  filled with copies whose answers are dropped, so every call has the same
  batch size). Prompts with P > ``max_prompt_tokens`` are skipped.
  ``cache_dir``: each finished batch's answers are saved there
  (``{cache_tag}-{temperature index}-{first row}.npz``) and a batch whose
  file exists is loaded instead of decoded, so an interrupted run resumes
  where it stopped with the same results (batches and seeds are
  deterministic for a recipe). ``only_cached``: decode nothing; prompts whose
  batch is not in ``cache_dir`` yet are left out (a snapshot of a running build).
  ``on_batch``: called with no argument after each batch saved to ``cache_dir``.

  Returns:
    (examples, stats): examples ``[(key, {"tokens": int32 [P + A],
    "loss_mask": int32 [P + A], "category": str})]`` in prompt order, key
    ``"IIIIIII:CATEGORY:T<temperature>"``, tokens = p + the A answer ids as
    emitted (a final stop id included), loss_mask = P zeros then A ones;
    stats: prompts, skipped_too_long, prompt_tokens, answer_tokens,
    stopped_fraction (rows that emitted a stop id), tau, wall_s.
  """
  tk = decoder.tokenizer
  encoded = [np.asarray(tk.apply_chat_template(p["messages"], add_generation_prompt=True),
                        np.int32) for p in prompts]
  keep = [i for i, e in enumerate(encoded) if len(e) <= max_prompt_tokens]
  too_long = len(prompts) - len(keep)
  temps = recipe.temperatures
  results: dict[int, np.ndarray] = {}
  calls = n_stop = resumed = 0
  t0 = time.perf_counter()
  for ti, temp in enumerate(temps):
    rows = sorted((i for i in keep if i % len(temps) == ti), key=lambda i: (len(encoded[i]), i))
    sp = SamplingParams(temp, recipe.top_k, recipe.top_p)
    for start in range(0, len(rows), recipe.batch_size):
      chunk = rows[start:start + recipe.batch_size]
      cached = (os.path.join(cache_dir, f"{cache_tag}-{ti}-{start:07d}.npz") if cache_dir
                else None)
      if cached and os.path.exists(cached):
        answers, row_calls = data_lib.load_partial_batch(cached, len(chunk))
        resumed += 1
      elif only_cached:
        continue
      else:
        batch = [encoded[i] for i in chunk]
        if len(rows) > recipe.batch_size:          # one batch shape: no recompilation
          batch += [batch[0]] * (recipe.batch_size - len(batch))
        gen = decoder.generate(batch, recipe.max_new_tokens, sp,
                               seed=(recipe.seed * 1_000_003 + seed_offset + start) * 31 + ti)
        answers = [np.asarray(gen.tokens[j], np.int32) for j in range(len(chunk))]
        row_calls = np.asarray(gen.target_calls[:len(chunk)], np.int64)
        if cached:
          data_lib.save_partial_batch(cached, answers, row_calls)
          if on_batch is not None:
            on_batch()
      for j, i in enumerate(chunk):
        ids = answers[j]
        results[i] = ids
        calls += int(row_calls[j])
        n_stop += bool(ids.size and int(ids[-1]) in decoder.eos_ids)
      if log is not None:
        log(f"answered {len(results)}/{len(keep)} prompts (T={temp:g}, "
            f"{sum(len(r) for r in results.values()):,} answer tokens, "
            f"{time.perf_counter() - t0:.0f} s)")
  wall = time.perf_counter() - t0
  if only_cached:
    keep = [i for i in keep if i in results]
  examples = [data_lib.chat_token_example(i, prompts[i]["category"], temps[i % len(temps)],
                                          encoded[i], results[i]) for i in keep]
  answer_tokens = sum(len(r) for r in results.values())
  stats = {"prompts": len(keep), "skipped_too_long": too_long,
           "prompt_tokens": int(sum(len(encoded[i]) for i in keep)),
           "answer_tokens": int(answer_tokens), "stopped_fraction": n_stop / max(len(keep), 1),
           "tau": answer_tokens / max(calls, 1), "wall_s": wall, "batches_resumed": resumed}
  return examples, stats


def make_chat_dataset(workdir: str, out_name: str, recipe: ChatRecipe, *, data_dir: str = "",
                      out_dir: str = "", log=print, snapshot: str = "", carry: str = "") -> dict:
  """Generates and writes a self-distilled chat token dataset (chat mode in
  the module docstring).

  Args:
    workdir: model directory with a chat-template tokenizer (e.g. an import).
    out_name: new TFDS dataset name (snake_case).
    recipe: prompt counts, sampling and batching settings.
    data_dir: TFDS data dir where the embedded corpora are built / read
      ("" = the workdir config's data.data_dir, else $MTP_DATA_DIR, else
      ~/.cache/mtp/tensorflow_datasets).
    out_dir: TFDS data dir to write into ("" = ``data_dir``).
    snapshot: a new dataset name: write the train answers that ``out_name``'s
      running (or stopped) build has finished so far as that dataset,
      decoding none of them (the small validation split is decoded and
      kept in the build's partial folder); the build goes on unchanged.
    carry: a ``.npz`` path ("" = none): its batches restored into the
      partial folder first; rewritten after every decoded batch.
  Returns:
    the metadata (recipe, per-split stats, paths); ``skipped: True`` when the
    dataset already existed with the same workdir and recipe (nothing done).
  Raises:
    CheckpointError, DataError (bad or existing name with another recipe),
    DecodeError (bad recipe, a tokenizer without a chat template, D = 0 with
    method mtp).
  """
  recipe.validate()
  cfg, _ = loading.load_config(workdir)
  src_dir = data_lib.resolve_data_dir(DataConfig(data_dir=data_dir or cfg.data.data_dir))
  out_dir = os.path.abspath(out_dir) if out_dir else src_dir
  recipe_json = chat_recipe_json(recipe)
  folder = os.path.join(out_dir, out_name)
  if snapshot:
    why = snapshot_error(snapshot, out_name, recipe.chat_prompts)
    stamp = os.path.join(out_dir, f".{out_name}.partial", "recipe.json")
    if why is None and not os.path.exists(stamp):
      why = (f"--snapshot: no partial build of '{out_name}' in {out_dir} (start it with the "
             "same arguments without --snapshot)")
    if why is None and os.path.exists(os.path.join(out_dir, snapshot)):
      why = f"--snapshot={snapshot!r}: dataset '{snapshot}' already exists in {out_dir}"
    if why is None:
      with open(stamp) as f:
        if json.load(f) != {"workdir": os.path.abspath(workdir), "recipe": recipe_json}:
          why = (f"--snapshot: the build of '{out_name}' was started with other arguments "
                 f"(its {stamp}); give the snapshot the build's exact arguments")
    if why:
      raise data_lib.DataError(why)
  elif os.path.exists(folder):
    old = data_lib.distilled_metadata(folder)
    if (old is not None and old.get("recipe") == recipe_json
        and old.get("workdir") == os.path.abspath(workdir)):
      if log is not None:
        log(f"dataset '{out_name}' already exists in {out_dir} with this workdir and recipe: "
            "nothing to do (delete the folder to regenerate it)")
      return {**old, "path": os.path.join(folder, data_lib.SELF_DISTILLED_VERSION),
              "data_dir": out_dir, "skipped": True}
  data_lib.check_dataset_name(out_name, out_dir)          # before minutes of sampling
  try:
    tokenizer = tok.load_tokenizer(workdir)
  except tok.TokenizerError as e:
    raise DecodeError(str(e)) from None
  if not tokenizer.chat_template:
    raise DecodeError(f"--chat_prompts needs a tokenizer with a chat template; {workdir!r} has "
                      f"a {tokenizer.kind} tokenizer without one (use the text mode: --num_docs)")
  cfg, model, step = loading.load_model(workdir)
  if recipe.method == "mtp" and cfg.mtp.depth < 1:
    raise DecodeError(f"--method=mtp needs a model with MTP modules; {workdir!r} has mtp.depth=0 "
                      "(use --method=ar)")
  g = recipe.num_draft_tokens or max(cfg.mtp.depth, 1)
  decoder = Decoder(model, recipe.method, g, tokenizer=tokenizer)
  max_prompt = cfg.model.max_seq_len - recipe.max_new_tokens
  if max_prompt < 1:
    raise DecodeError(f"--max_new_tokens={recipe.max_new_tokens} leaves no room for a prompt in "
                      f"the model's max_seq_len={cfg.model.max_seq_len}")
  kw = dict(seed=recipe.seed, data_dir=src_dir, categories=recipe.categories,
            max_context_chars=recipe.max_context_chars)
  partial = data_lib.partial_run_dir(out_dir, out_name, workdir, recipe_json, log)
  on_batch = None
  if carry:
    os.makedirs(os.path.dirname(os.path.abspath(carry)), exist_ok=True)
    if os.path.exists(carry):
      n = data_lib.unpack_partial(carry, partial, recipe_json)
      if log is not None:
        log(f"--carry: {n} batches restored from {carry}")
    if not snapshot:
      on_batch = lambda: data_lib.pack_partial(partial, carry)
  t0 = time.perf_counter()
  splits, per_split = {}, {}
  for split, n, offset in (("train", recipe.chat_prompts, 0),
                           ("validation", recipe.val_prompts, 1 << 20)):
    if n == 0:
      continue
    prompts = training_chat_prompts(recipe, n, split, kw)
    if log is not None:
      log(f"{split}: {n} chat prompts")
    splits[split], per_split[split] = answer_examples(
        decoder, prompts, recipe, max_prompt_tokens=max_prompt, seed_offset=offset, log=log,
        cache_dir=partial, cache_tag=split, only_cached=bool(snapshot) and split == "train",
        on_batch=on_batch)
    per_split[split]["categories"] = {c: sum(1 for _, e in splits[split] if e["category"] == c)
                                      for c in sorted({*recipe.categories,
                                                       *(p["category"] for p in prompts)})}
  meta = {"generator": "scripts.self_distill (chat)", "workdir": os.path.abspath(workdir),
          "step": int(step), "tokenizer": tokenizer.kind, "recipe": recipe_json,
          "num_draft_tokens": g if recipe.method == "mtp" else 0,
          "features": {"tokens": "int32 [n]", "loss_mask": "int32 [n]", "category": "str",
                       "name": "str"},
          "splits": per_split, "wall_s": time.perf_counter() - t0,
          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
          "tokens_generated": sum(v["answer_tokens"] for v in per_split.values()),
          "date": datetime.date.today().isoformat()}
  if snapshot:        # the build's folder stays: it goes on from there
    meta["snapshot_of"] = {"name": out_name, "train_prompts_answered": len(splits["train"]),
                           "train_prompts": recipe.chat_prompts}
    return {**meta, "path": data_lib.write_token_dataset(snapshot, out_dir, splits, meta),
            "data_dir": out_dir, "skipped": False}
  path = data_lib.write_token_dataset(out_name, out_dir, splits, meta)
  shutil.rmtree(partial, ignore_errors=True)
  return {**meta, "path": path, "data_dir": out_dir, "skipped": False}


# -- command line --------------------------------------------------------------------------

def main(argv=None) -> int:
  ap = cli.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
  ap.add_argument("--method", default=None, choices=[m for m in METHODS if m != "draft"],
                  help="decoder (both sample the main model exactly; mtp is faster; default "
                  f"{d.method}, {ChatRecipe.method} with --chat_prompts)")
  ap.add_argument("--num_draft_tokens", type=int, default=d.num_draft_tokens,
                  help="G for --method=mtp (0 = the model's depth D)")
  ap.add_argument("--batch_size", type=int, default=None, help="rows decoded together "
                  f"(default {d.batch_size}; {ChatRecipe.batch_size} with --chat_prompts)")
  ap.add_argument("--seed", type=int, default=d.seed, help="prompt choice and sampling seed")
  c = ChatRecipe()
  chat = ap.add_argument_group("chat mode (a workdir with a chat template; writes token ids)")
  chat.add_argument("--chat_prompts", type=int, default=0, help="training chat prompts built "
                    "from the embedded corpora (0 = the text mode above)")
  chat.add_argument("--val_prompts", type=int, default=c.val_prompts,
                    help="validation chat prompts (from the corpora's validation documents)")
  chat.add_argument("--temperatures", default=None, help="comma-separated temperatures, prompt "
                    "i sampled at the (i mod k)-th (default: --temperature)")
  chat.add_argument("--max_context_chars", type=int, default=c.max_context_chars,
                    help="longest document excerpt in a prompt (characters, >= 200)")
  chat.add_argument("--categories", default=",".join(c.categories),
                    help="comma-separated prompt categories")
  chat.add_argument("--self_prompts", default="", help="a self-written prompt file "
                    "(python -m scripts.self_prompts) to mix into the training prompts")
  chat.add_argument("--self_prompt_share", type=float, default=0.0,
                    help="share of the training prompts taken from --self_prompts, in [0, 1]")
  chat.add_argument("--snapshot", default="", help="a new dataset name: write what the build of "
                    "--out_name (same arguments, running or stopped) has answered so far as "
                    "that dataset, decoding no training prompt; the build goes on")
  chat.add_argument("--carry", default="", help="a .npz that carries the unfinished build to "
                    "another checkout: restored before the build starts, rewritten after "
                    "every batch (commit it to resume elsewhere)")
  args = ap.parse_args(argv)
  why = snapshot_error(args.snapshot, args.out_name, args.chat_prompts)
  if why:
    print(f"error: {why}", file=sys.stderr)
    return 2
  if args.out_dir or args.data_dir:
    cli.check_output_path("out_dir" if args.out_dir else "data_dir", args.out_dir or args.data_dir,
                          "dir")
  if args.carry:
    cli.check_output_path("carry", args.carry, "file")
  log = lambda s: print(s, file=sys.stderr, flush=True)
  if args.chat_prompts:
    try:
      temps = (parse_temperatures(args.temperatures) if args.temperatures is not None
               else (args.temperature,))
      method = args.method or c.method
      recipe = ChatRecipe(
          chat_prompts=args.chat_prompts, val_prompts=args.val_prompts, temperatures=temps,
          top_k=args.top_k, top_p=args.top_p, max_new_tokens=args.max_new_tokens, method=method,
          num_draft_tokens=args.num_draft_tokens,
          batch_size=args.batch_size if args.batch_size is not None else c.batch_size,
          seed=args.seed, max_context_chars=args.max_context_chars,
          categories=tuple(cli.list_items(ap, "categories", args.categories)),
          self_prompts=args.self_prompts, self_prompt_share=args.self_prompt_share)
      meta = make_chat_dataset(args.workdir, args.out_name, recipe, data_dir=args.data_dir,
                               out_dir=args.out_dir, log=log, snapshot=args.snapshot,
                               carry=args.carry)
    except (DecodeError, ckpt_lib.CheckpointError, data_lib.DataError) as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    name = args.snapshot or args.out_name
    if not meta["skipped"]:
      counts = ", ".join(f"{k} {v['prompts']} examples ({v['answer_tokens']:,} answer tokens)"
                         for k, v in meta["splits"].items())
      print(f"wrote {counts} in {meta['wall_s']:.0f} s to {meta['path']}; train on it with "
            f"--config.data.name={name} --config.data.data_dir={meta['data_dir']}")
    return 0
  if args.batch_size is None:
    args.batch_size = d.batch_size
  args.method = args.method or d.method
  recipe = Recipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe)})
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
  cli.main_guard(main)
