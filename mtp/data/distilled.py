"""Self-distilled datasets on disk, around their writing
(``write_dataset`` / ``write_token_dataset`` in ``corpora.py``): the
metadata of one that exists, the partial folder of an unfinished chat run
(its recipe stamp and the answers of finished batches; packed into one file
to carry it to another checkout), and the token
examples (chat prompt + answer, ``loss_mask``) that ``scripts.self_distill``
writes.
"""

from __future__ import annotations

import io
import json
import os
import zipfile

import numpy as np

from mtp.files import write_atomic
from mtp.data.corpora import SELF_DISTILLED_VERSION, DataError


def distilled_metadata(folder: str) -> dict | None:
  """The metadata.json of the self-distilled dataset in ``folder``
  (``DATA_DIR/NAME``, version ``SELF_DISTILLED_VERSION``), or None when it is
  missing or not valid JSON."""
  try:
    with open(os.path.join(folder, SELF_DISTILLED_VERSION, "metadata.json")) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def partial_run_dir(out_dir: str, out_name: str, workdir: str, recipe_json: dict, log) -> str:
  """``OUT_DIR/.OUT_NAME.partial``: the answers of finished batches of an
  unfinished run (``scripts.self_distill.answer_examples(cache_dir=...)``),
  with the recipe that made them (``recipe.json``: the absolute ``workdir``
  and ``recipe_json``); created when missing. ``log``: line printer or None
  (says how many batches a resumed run finds).

  Raises DataError when the folder holds another workdir's or recipe's run.
  """
  folder = os.path.join(out_dir, f".{out_name}.partial")
  want = {"workdir": os.path.abspath(workdir), "recipe": recipe_json}
  stamp = os.path.join(folder, "recipe.json")
  if os.path.exists(stamp):
    with open(stamp) as f:
      have = json.load(f)
    if have != want:
      raise DataError(
          f"{folder} holds the partial output of another run ({have}); resume it with the same "
          "arguments or delete that folder")
    n = len([f for f in os.listdir(folder) if f.endswith(".npz") and ".tmp" not in f])
    if log is not None and n:
      log(f"resuming: {n} finished batches in {folder}")
  else:
    os.makedirs(folder, exist_ok=True)
    write_atomic(stamp, json.dumps(want))
  return folder


def load_partial_batch(path: str, n: int) -> tuple[list[np.ndarray], np.ndarray]:
  """A finished batch saved by ``save_partial_batch``: its ``n`` answers
  (int32 [A_j] each) and per row the target calls (int64 [n])."""
  with np.load(path) as f:
    return [f[f"a{j}"] for j in range(n)], f["calls"]


def save_partial_batch(path: str, answers: list[np.ndarray], calls: np.ndarray) -> None:
  """Saves a batch's answers and target calls to ``path`` (an ``.npz``),
  atomically (``mtp.cli.write_atomic``: a temporary file of its own, so two
  writers never share one)."""
  buf = io.BytesIO()
  np.savez(buf, calls=calls, **{f"a{j}": a for j, a in enumerate(answers)})
  write_atomic(path, buf.getvalue())


def pack_partial(folder: str, path: str) -> int:
  """Writes the finished batches of the partial folder ``folder`` and its
  recipe into one compressed ``.npz`` at ``path``, atomically, so that an
  unfinished build can be committed and resumed in another checkout
  (``unpack_partial``). Keys: ``recipe`` (uint8 [n], the recipe JSON
  without the absolute workdir) and ``<batch file stem>/<array name>``.
  Returns the number of batches packed."""
  with open(os.path.join(folder, "recipe.json")) as f:
    recipe = json.load(f)["recipe"]
  arrays = {"recipe": np.frombuffer(json.dumps(recipe, sort_keys=True).encode(), np.uint8)}
  names = sorted(f for f in os.listdir(folder) if f.endswith(".npz") and ".tmp" not in f)
  for name in names:
    with np.load(os.path.join(folder, name)) as batch:
      arrays.update({f"{name[:-4]}/{k}": batch[k] for k in batch.files})
  buf = io.BytesIO()
  np.savez_compressed(buf, **arrays)
  write_atomic(path, buf.getvalue())
  return len(names)


def unpack_partial(path: str, folder: str, recipe_json: dict) -> int:
  """Restores into ``folder`` (a ``partial_run_dir``) the batches of
  ``pack_partial``'s file at ``path`` that the folder lacks; returns how
  many. Raises DataError when the file is not a packed build or was packed
  from another recipe."""
  try:
    with np.load(path) as packed:
      have = json.loads(packed["recipe"].tobytes())
      batches: dict[str, dict[str, np.ndarray]] = {}
      for key in packed.files:
        if "/" in key:
          stem, name = key.split("/", 1)
          batches.setdefault(stem, {})[name] = packed[key]
  except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
    raise DataError(f"--carry {path}: not a build packed by --carry ({e}); move it away to "
                    "start a new one") from None
  if have != json.loads(json.dumps(recipe_json, sort_keys=True)):
    raise DataError(f"--carry {path} holds a build with another recipe ({have}); give the "
                    "build that file's arguments or another --carry path")
  restored = 0
  for stem, arrays in batches.items():
    out = os.path.join(folder, stem + ".npz")
    if not os.path.exists(out):
      buf = io.BytesIO()
      np.savez(buf, **arrays)
      write_atomic(out, buf.getvalue())
      restored += 1
  return restored


def chat_token_example(index: int, category: str, temperature: float, prompt: np.ndarray,
                       answer: np.ndarray) -> tuple[str, dict]:
  """One token example of chat prompt ``index``: key
  ``"IIIIIII:CATEGORY:T<temperature>"`` and ``{"tokens": int32 [P + A]
  (prompt ids then answer ids), "loss_mask": int32 [P + A] (P zeros then A
  ones), "category"}``."""
  return (f"{index:07d}:{category}:T{temperature:g}", {
      "tokens": np.concatenate([prompt, answer]).astype(np.int32),
      "loss_mask": np.concatenate([np.zeros(len(prompt), np.int32),
                                   np.ones(len(answer), np.int32)]),
      "category": category})
