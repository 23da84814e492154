"""Chat mode of ``python -m decode.self_distill`` (``--chat_prompts N``; the
module docstring of ``decode.self_distill`` describes the dataset): chat
prompts built from the embedded corpora (``mtp.data.chat_prompts``),
rendered with the workdir tokenizer's chat template and answered by the
model with ``decode.speculative.Decoder``; the answers are written as a
token dataset (``mtp.data.write_token_dataset``). An interrupted run
resumes from the finished batches in its partial folder
(``mtp.data.partial_run_dir``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import resource
import shutil
import time

import numpy as np

from decode.speculative import DecodeError, Decoder, SamplingParams
from mtp import data as data_lib
from mtp import loading
from mtp import tokenizer as tok
from mtp.config import DataConfig


@dataclasses.dataclass(frozen=True)
class ChatRecipe:
  """How a self-distilled chat token dataset is made (recorded in its metadata).

  chat_prompts >= 1 training prompts; val_prompts >= 0 validation prompts;
  temperatures: non-empty tuple of temperatures >= 0 (prompt i uses
  ``temperatures[i % len]``); top_k >= 0, top_p in (0, 1]; max_new_tokens
  >= 1; method "ar" or "mtp"; num_draft_tokens >= 0 (0 = D); batch_size >= 1;
  seed >= 0; max_context_chars >= 200 (``mtp.data.chat_prompts``);
  categories: a non-empty subset of ``mtp.data.CHAT_CATEGORIES``.
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
    bad = [c for c in self.categories if c not in data_lib.CHAT_CATEGORIES]
    if not self.categories or bad:
      raise DecodeError(f"--categories={','.join(self.categories)!r}: each must be one of "
                        f"{','.join(data_lib.CHAT_CATEGORIES)}")
    return self


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
                    cache_dir: str | None = None, cache_tag: str = "train"
                    ) -> tuple[list[tuple[str, dict]], dict]:
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
  deterministic for a recipe).

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
  examples = [data_lib.chat_token_example(i, prompts[i]["category"], temps[i % len(temps)],
                                          encoded[i], results[i]) for i in keep]
  answer_tokens = sum(len(r) for r in results.values())
  stats = {"prompts": len(keep), "skipped_too_long": len(prompts) - len(keep),
           "prompt_tokens": int(sum(len(encoded[i]) for i in keep)),
           "answer_tokens": int(answer_tokens), "stopped_fraction": n_stop / max(len(keep), 1),
           "tau": answer_tokens / max(calls, 1), "wall_s": wall, "batches_resumed": resumed}
  return examples, stats


def make_chat_dataset(workdir: str, out_name: str, recipe: ChatRecipe, *, data_dir: str = "",
                      out_dir: str = "", log=print) -> dict:
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
  recipe_json = json.loads(json.dumps(dataclasses.asdict(recipe)))
  folder = os.path.join(out_dir, out_name)
  if os.path.exists(folder):
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
  t0 = time.perf_counter()
  splits, per_split = {}, {}
  for split, n, offset in (("train", recipe.chat_prompts, 0),
                           ("validation", recipe.val_prompts, 1 << 20)):
    if n == 0:
      continue
    prompts = data_lib.chat_prompts(n, split=split, **kw)
    if log is not None:
      log(f"{split}: {n} chat prompts")
    splits[split], per_split[split] = answer_examples(
        decoder, prompts, recipe, max_prompt_tokens=max_prompt, seed_offset=offset, log=log,
        cache_dir=partial, cache_tag=split)
    per_split[split]["categories"] = {c: sum(1 for _, e in splits[split] if e["category"] == c)
                                      for c in recipe.categories}
  meta = {"generator": "decode.self_distill (chat)", "workdir": os.path.abspath(workdir),
          "step": int(step), "tokenizer": tokenizer.kind, "recipe": recipe_json,
          "num_draft_tokens": g if recipe.method == "mtp" else 0,
          "features": {"tokens": "int32 [n]", "loss_mask": "int32 [n]", "category": "str",
                       "name": "str"},
          "splits": per_split, "wall_s": time.perf_counter() - t0,
          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
          "tokens_generated": sum(v["answer_tokens"] for v in per_split.values()),
          "date": datetime.date.today().isoformat()}
  path = data_lib.write_token_dataset(out_name, out_dir, splits, meta)
  shutil.rmtree(partial, ignore_errors=True)
  return {**meta, "path": path, "data_dir": out_dir, "skipped": False}
