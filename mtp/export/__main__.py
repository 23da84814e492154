"""python -m mtp.export --workdir W --out DIR [--overwrite] [--step N]

Writes checkpoint N (default: the latest) of workdir W as a Hugging Face
``LlamaForCausalLM`` directory with the MTP modules under DeepSeek-V3 naming
(``mtp.export``; mapping table in docs/export.md). Parses flags and calls
``mtp.export.run.export``; errors print one line and exit with status 2.
"""

import os
import sys

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "Trained run directory (python -m train).")
_OUT = flags.DEFINE_string("out", None, "Output directory (must not exist unless --overwrite).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace --out if it holds an earlier export "
                               "(or is empty).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to export (default: latest).")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.ERROR)   # orbax warns about read-only managers
  from mtp.checkpoint import CheckpointError
  from mtp.export import WEIGHTS_FILE, ExportError
  from mtp.export.run import export
  try:
    out = export(_WORKDIR.value, _OUT.value, step=_STEP.value, overwrite=_OVERWRITE.value)
  except (ExportError, CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  size = os.path.getsize(os.path.join(out, WEIGHTS_FILE))
  print(f"wrote {out} ({', '.join(sorted(os.listdir(out)))}; {size / 2**20:.1f} MiB of weights)")
  return 0


if __name__ == "__main__":
  from mtp.cli import parse_flags_or_exit
  app.run(main, flags_parser=parse_flags_or_exit)
