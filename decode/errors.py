"""Decoding errors: ``DecodeError`` (bad input, raised on the host before
anything runs) and ``NonFiniteLogitsError`` (NaN/inf logits; the jitted
round stops the row and sets ``DecodeState.error`` / ``error_pos``,
``raise_on_error`` raises on the host copy)."""

from __future__ import annotations

import numpy as np

ERROR_NONE, ERROR_TARGET, ERROR_DRAFTER = 0, 1, 2


class DecodeError(ValueError):
  """Bad decoding input (the message names the flag or field and its range)."""


class NonFiniteLogitsError(RuntimeError):
  """The target or the drafter produced NaN/inf logits during a generation.
  Attributes: ``rows`` (per row, the tokens emitted before it stopped), ``row``
  and ``position`` (first failing row, position of the non-finite logits),
  ``source`` ("target" or "drafter")."""

  def __init__(self, message: str, *, rows=None, row=None, position=None, source=None):
    super().__init__(message)
    self.rows, self.row, self.position, self.source = rows, row, position, source


def emitted_rows(tokens: np.ndarray, prompt_len: np.ndarray, length: np.ndarray) -> list[np.ndarray]:
  """Per row, the generated ids: tokens [B, S] int32 between prompt_len[i]
  and length[i] (host numpy arrays)."""
  return [tokens[i, prompt_len[i]:length[i]].copy() for i in range(tokens.shape[0])]


def raise_on_error(tokens, prompt_len, length, error, error_pos) -> None:
  """Raises NonFiniteLogitsError for the first row whose ``error`` is set
  (host numpy copies of the state's fields: tokens [B, S], the rest [B])."""
  bad = np.nonzero(error)[0]
  if not len(bad):
    return
  r = int(bad[0])
  who = "target" if error[r] == ERROR_TARGET else "drafter"
  pos = int(error_pos[r])
  emitted = int(length[r] - prompt_len[r])
  more = f" ({len(bad) - 1} other row(s) too)" if len(bad) > 1 else ""
  raise NonFiniteLogitsError(
      f"the {who} produced non-finite logits (NaN or inf) for row {r} at position {pos} "
      f"(predicting token {pos + 1}, after {emitted} generated token(s)){more}; the row was "
      "stopped and nothing computed from those logits was emitted. The weights are damaged, "
      "diverged or overflow in this dtype",
      rows=emitted_rows(tokens, prompt_len, length), row=r, position=pos, source=who)
