"""absl flag parsing with the project's bad-input exit status.

absl exits with status 1 on an unknown or malformed flag; every CLI here
documents 2 for bad input (``python -m train``, ``python -m decode``,
``python -m mtp.export``), so their ``app.run`` uses this parser.
"""

from __future__ import annotations

import sys

from absl import flags

BAD_INPUT = 2


def parse_flags_or_exit(argv: list[str]) -> list[str]:
  """``flags.FLAGS(argv)``; on a flags error prints one line
  ``error: ...`` (and the usage hint) to stderr and exits with status 2."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f"error: {e}\nPass --helpfull to see the flags.", file=sys.stderr)
    sys.exit(BAD_INPUT)
