"""The ranges of ``python -m decode``'s flags and their checks, without jax
(the CLI checks its flags before jax or a model loads). Each check raises
``DecodeError``: one line naming the flag and its range."""

from __future__ import annotations

import math
import numbers

from decode.errors import DecodeError

MAX_DRAFT_TOKENS = 16        # G (fixed) and auto's G_max: a draft longer than this never pays
MAX_TOP_K = 2 ** 31 - 1      # top_k is an int32 on the device
MAX_NEW_TOKENS = 2 ** 31 - 1
MAX_SAMPLES = 65536
MAX_REPEATS = 1000
MAX_SEED = 2 ** 32 - 1
DTYPES = ("float32", "bfloat16")   # --dtype
METHODS = ("ar", "mtp", "draft")   # --method


def parse_num_draft_tokens(text) -> int | str:
  """``--num_draft_tokens``: an integer in [1, ``MAX_DRAFT_TOKENS``] or
  "auto". Raises DecodeError."""
  if isinstance(text, int) and not isinstance(text, bool):
    value = text
  elif str(text).strip().lower() == "auto":
    return "auto"
  else:
    try:
      value = int(str(text).strip())
    except ValueError:
      value = None
  if value is None or not 1 <= value <= MAX_DRAFT_TOKENS:
    raise DecodeError(f"--num_draft_tokens={text!r} must be an integer in [1, {MAX_DRAFT_TOKENS}] "
                      "or 'auto'")
  return value


def check_counts(*, max_new_tokens, num_samples, seed, repeats, max_draft_tokens=None) -> None:
  """The integer settings of ``decode.cli.run.run``, each in its range."""
  def integer(name, value, lo, hi):
    if not (isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi):
      raise DecodeError(f"--{name}={value!r} must be an integer in [{lo}, {hi}]")
  integer("max_new_tokens", max_new_tokens, 1, MAX_NEW_TOKENS)
  integer("num_samples", num_samples, 1, MAX_SAMPLES)
  integer("seed", seed, 0, MAX_SEED)
  integer("repeats", repeats, 1, MAX_REPEATS)
  if max_draft_tokens is not None:
    integer("max_draft_tokens", max_draft_tokens, 1, MAX_DRAFT_TOKENS)


def check_sampling(temperature, top_k, top_p, is_array=lambda x: False) -> None:
  """Sampling settings given as Python or numpy numbers (``is_array(x)``:
  pass unchecked): temperature a finite number >= 0 (0 = greedy), top_k an
  integer in [0, 2**31 - 1] (0 = off), top_p a number in (0, 1] (1 = off)."""
  def number(x):
    if is_array(x):
      return None
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
      return x
    return "bad"
  t, k, p = number(temperature), number(top_k), number(top_p)
  if t is not None and (t == "bad" or not (math.isfinite(t) and t >= 0)):
    raise DecodeError(f"--temperature={temperature!r} must be a finite number >= 0 (0 = greedy)")
  if k is not None and (k == "bad" or not (math.isfinite(k) and float(k).is_integer()
                                          and 0 <= k <= MAX_TOP_K)):
    raise DecodeError(f"--top_k={top_k!r} must be an integer in [0, {MAX_TOP_K}] "
                      "(0 disables top-k)")
  if p is not None and (p == "bad" or not 0.0 < p <= 1.0):
    raise DecodeError(f"--top_p={top_p!r} must be in (0, 1] (1 disables top-p)")


def check_overrides(dtype: str | None, attention_impl: str | None) -> None:
  """``--dtype`` (None or one of ``DTYPES``) and ``--attention_impl`` (None or
  a string; its allowed values are checked by ``mtp.config`` against the
  checkpoint's config in ``decode.cli.run.model_overrides``)."""
  if dtype is not None and dtype not in DTYPES:
    raise DecodeError(f"--dtype={dtype!r} is not allowed: must be one of {', '.join(DTYPES)} "
                      "(default: the checkpoint's model.dtype)")
  if attention_impl is not None and not isinstance(attention_impl, str):
    raise DecodeError(f"--attention_impl={attention_impl!r} must be a string")


def check_flags(method: str, num_draft_tokens, tree=None) -> None:
  """The rules between --method, --num_draft_tokens and --tree that need no
  model (``resolve_method`` checks the rest against the checkpoint): a
  known method, a tree only with "mtp", "auto" not with "draft".

  Raises DecodeError, one line naming the flags."""
  if method not in METHODS:
    raise DecodeError(f"--method={method!r} must be one of {METHODS}")
  if tree is not None and method != "mtp":
    raise DecodeError(f"--tree needs --method=mtp (the MTP modules draft the tree); got "
                      f"--method={method}")
  if tree is None and method == "draft" and num_draft_tokens == "auto":
    raise DecodeError(f"--num_draft_tokens=auto needs --method=mtp (got --method={method})")
