"""Silences third-party log messages that say nothing to our users, at their
logger and only for the block that triggers them (every other message of
those libraries still shows).

orbax, TFDS and grain log through absl, whose records all go to the Python
logger named "absl"; a filter on that logger drops a record before any
handler sees it.
"""

from __future__ import annotations

import contextlib
import logging

# orbax.checkpoint.CheckpointManager with read_only=True: it warns that the
# directory is read only (we asked for that) and that it turns off saving
# options we never set.
ORBAX_READ_ONLY = ("Given directory is read only",
                   "CheckpointManagerOptions.read_only=True, setting")
# orbax restoring a step whose _CHECKPOINT_METADATA (its save timestamps,
# nothing we read) is gone: the restore works and our array checksums still
# verify every array, so the warning says nothing a user can act on.
ORBAX_NO_STEP_METADATA = ("Metadata file does not exist",)
# TFDS while building a dataset: the version folder it is writing has no
# dataset_info.json yet.
TFDS_BUILDING = ("Variant folder %s has no %s",)


class _DropPrefixes(logging.Filter):
  """Drops records whose unformatted message starts with one of ``prefixes``."""

  def __init__(self, prefixes: tuple[str, ...]):
    super().__init__()
    self.prefixes = tuple(prefixes)

  def filter(self, record: logging.LogRecord) -> bool:
    return not (isinstance(record.msg, str) and record.msg.startswith(self.prefixes))


@contextlib.contextmanager
def absl_messages_dropped(*prefixes: str, logger: str = "absl"):
  """Within the block, drops records of ``logger`` (default: absl's, which
  orbax and TFDS use) whose format string (before %-substitution) starts
  with one of ``prefixes``. Other records pass unchanged."""
  target = logging.getLogger(logger)
  f = _DropPrefixes(prefixes)
  target.addFilter(f)
  try:
    yield
  finally:
    target.removeFilter(f)
