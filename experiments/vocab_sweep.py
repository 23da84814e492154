"""Acceptance of trained MTP modules against the size of the draft vocabulary
V' (issue 22 item 3; FastMTP's compressed draft vocabulary).

One trained stage (a workdir with MTP modules, usually trained with one V')
is evaluated with V' set to the N most frequent answer ids of its own train
split, for several N, and without V' ("full"): the rule of
``train.loop.attach_draft_vocab`` (``select_draft_vocab``), so the sets are
nested and the V' the stage trained with comes back exactly. Per V' and per
draft step k = 1..D+R (``mtp.recursive_steps`` R: module D reused) the
validation batches give, from ``train.losses.mtp_loss`` / ``summarize``:

    alpha_t0      ``teacher_agreement_full``: the module's argmax equals the
                  full main head's, a T = 0 draft's acceptance
    alpha_t1      ``teacher_overlap``: E[sum_v min(p, q)], a T = 1 draft's
                  acceptance (Leviathan et al. 2023, section 3.3)
    mass_outside  ``teacher_mass_outside``: the main head's mass outside V'
                  (alpha_t1 <= 1 - it); 0 without V'

all along the data's path (teacher forcing: step k sees the true tokens
before it, not its own drafts). The backbone runs once per batch; each V'
reruns only the heads and the modules on its output (``forward_from_hidden``).

The stage's evaluation (train's loss sums, data pipeline and selection
rule), kept beside its only user, experiments/sweep_draft_vocab.py, which
puts it together with the draft cost against V' (decoding's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx

from mtp import data as data_lib
from mtp import draft_vocab as draft_vocab_lib
from mtp import loading
from mtp import tokenizer as tok_lib
from mtp.config import Config
from train import losses
from train.loop import select_draft_vocab

FULL = "full"


@dataclasses.dataclass
class Stage:
  """A trained stage and its data: ``cfg`` (the checkpoint's config), ``model``
  (``mtp.model.Transformer``), ``step``, ``tokenizer``, ``counts`` [V] int64
  (target ids of the train split where loss_mask == 1,
  ``mtp.draft_vocab.token_counts``) and ``batches`` (validation batches,
  ``mtp.data.make_eval_batches``: tokens, positions, segment_ids and
  loss_mask [B, T] int32, T = ``train.seq_len``)."""
  cfg: Config
  model: Any
  step: int
  tokenizer: Any
  counts: np.ndarray
  batches: list


def load_stage(workdir: str, step: int | None = None, *, batch_size: int, num_batches: int,
               data_dir: str | None = None, data_name: str | None = None) -> Stage:
  """The ``Stage`` of ``workdir`` at checkpoint ``step`` (default the latest):
  its data is the checkpoint's ``cfg.data`` (``data_dir`` / ``data_name``
  replace its fields when given), read like
  ``train.loop`` reads it (its tokenizer for a BPE model), ``num_batches``
  validation batches of ``batch_size`` rows.
  Raises CheckpointError (no readable checkpoint), DataError (no such data,
  or an empty validation split), ValueError (no MTP modules)."""
  cfg, model, step = loading.load_model(workdir, step)
  if not model.mtp_depth:
    raise ValueError(f"{workdir} has no MTP modules (mtp.depth = 0): nothing drafts from V'")
  tk = tok_lib.load_tokenizer(workdir)
  data = dataclasses.replace(cfg.data, **{k: v for k, v in (("data_dir", data_dir),
                                                            ("name", data_name)) if v})
  kw = {} if cfg.model.tokenizer == "byte" else {"tokenizer": tk}
  rows = data_lib.epoch_rows(data, seq_len=cfg.train.seq_len, split=data.train_split, **kw)
  counts = draft_vocab_lib.token_counts(rows["tokens"], rows.get("loss_mask"),
                                        vocab_size=cfg.model.vocab_size)
  batches = data_lib.make_eval_batches(data, seq_len=cfg.train.seq_len, batch_size=batch_size,
                                       num_batches=num_batches, **kw)
  if not batches:
    raise data_lib.DataError(f"the {data.eval_split!r} split of {data.name!r} has no rows")
  return Stage(cfg, model, step, tk, counts, batches)


def vocab_sets(stage: Stage, sizes) -> dict[str, np.ndarray | None]:
  """{label: V' ids [N] int32 (``select_draft_vocab`` over ``stage.counts``)
  or None}: label str(N) for each N in ``sizes``, ``FULL`` (no V') for
  None or N >= the candidate count (an N that lets every emittable id in is
  the full head). Raises ValueError for N < 1 or N below the stop ids."""
  out = {}
  allowed = int(np.asarray(tok_lib.head_mask(stage.cfg.model)).sum())
  for n in sizes:
    if n is None or n >= allowed:
      out[FULL] = None
    else:
      out[str(n)] = select_draft_vocab(stage.cfg, stage.counts, stage.tokenizer, int(n))
  return out


def _hidden(model, batches) -> list:
  graphdef, params = nnx.split(model, nnx.Param)
  fn = jax.jit(lambda p, b: nnx.merge(graphdef, p).backbone_hidden(
      b["tokens"], b["positions"], b["segment_ids"]))
  return [fn(params, b) for b in batches]


def _sums_fn(model, steps: int, byte_level: bool):
  graphdef, params = nnx.split(model, nnx.Param)

  def sums(p, b, h0):
    m = nnx.merge(graphdef, p)
    h0, lower = m.split_hidden(h0)
    out = m.forward_from_hidden(b["tokens"], b["positions"], b["segment_ids"], h0,
                                recursive_steps=steps, lower=lower)
    return losses.mtp_loss(out, b["tokens"], b["segment_ids"], 1.0, depth=m.mtp_depth,
                           loss_mask=b.get("loss_mask"), byte_level=byte_level)[1]
  return jax.jit(sums), params


def acceptance(stage: Stage, vocabs: dict[str, np.ndarray | None],
               steps: int | None = None, log=None) -> list[dict]:
  """One row per V' of ``vocabs`` (``vocab_sets``): {draft_vocab (label),
  size (N, or V for ``FULL``), covers (share of the train split's target
  tokens inside V'), same_as_checkpoint (the ids equal the stage's own V'
  when the sizes match, else None), depths: [{k, alpha_t0, alpha_t1,
  mass_outside, positions}] for k = 1..D+steps} (module docstring; steps
  default ``mtp.recursive_steps``). ``log`` gets one line per V'."""
  steps = stage.cfg.mtp.recursive_steps if steps is None else steps
  model, total = stage.model, max(int(stage.counts.sum()), 1)
  own = draft_vocab_lib.draft_vocab_ids(model)
  hidden = _hidden(model, stage.batches)
  rows = []
  for label, ids in vocabs.items():
    fn, params = _sums_fn(draft_vocab_lib.with_draft_vocab_size(model, ids), steps,
                          stage.cfg.model.tokenizer == "byte")
    acc = None
    for b, h0 in zip(stage.batches, hidden):
      s = fn(params, b, h0)
      acc = s if acc is None else jax.tree.map(lambda x, y: x + y, acc, s)
    acc = jax.tree.map(float, jax.device_get(acc))
    m = losses.summarize(acc)
    depths = []
    for k in range(1, model.mtp_depth + steps + 1):
      h = f"mtp_{k}"
      full = ids is None
      depths.append({
          "k": k, "positions": int(acc[h]["positions"] if not full else acc[h]["count"]),
          "alpha_t0": m[f"{h}/teacher_agreement" if full else f"{h}/teacher_agreement_full"],
          "alpha_t1": m[f"{h}/teacher_overlap"],
          "mass_outside": 0.0 if full else m[f"{h}/teacher_mass_outside"]})
    same = None if ids is None or own is None or len(own) != len(ids) else bool(
        np.array_equal(own, ids))
    rows.append({"draft_vocab": label, "size": len(ids) if ids is not None else
                 stage.cfg.model.vocab_size,
                 "covers": 1.0 if ids is None else float(stage.counts[ids].sum()) / total,
                 "same_as_checkpoint": same, "depths": depths})
    if log:
      log(f"V' {label}: " + "  ".join(
          f"k={d['k']} a0 {d['alpha_t0']:.3f} a1 {d['alpha_t1']:.3f} out {d['mass_outside']:.3f}"
          for d in depths))
  return rows
