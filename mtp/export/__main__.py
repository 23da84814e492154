"""python -m mtp.export --workdir W (--out DIR | --modules_out FILE.safetensors)
[--overwrite] [--step N] [--modules_dtype bfloat16|float32]

``--out``: writes checkpoint N (default: the latest) of workdir W as a
Hugging Face ``LlamaForCausalLM`` directory with the MTP modules under
DeepSeek-V3 naming (``mtp.export``; mapping table in docs/export.md).
``--modules_out``: writes only its MTP modules and draft vocabulary as a
small safetensors file (``mtp.export.modules``; docs/import.md), for
``python -m mtp.importers ... --mtp_modules FILE``. Parses flags and calls
``mtp.export.run``; errors (a full disk included) print one line and exit
with status 2.
"""

import os
import shlex
import sys

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "Trained run directory (python -m train).")
_OUT = flags.DEFINE_string("out", None, "Output directory (must not exist unless --overwrite).")
_MODULES_OUT = flags.DEFINE_string("modules_out", None,
                                   "Output MTP modules file (.safetensors; must not exist unless "
                                   "--overwrite): the MTP modules and draft vocabulary only.")
_MODULES_DTYPE = flags.DEFINE_enum("modules_dtype", "bfloat16", ["bfloat16", "float32"],
                                   "Float dtype of the tensors of --modules_out.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace --out if it holds an earlier export "
                               "(or is empty), or --modules_out if it is a modules file.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to export (default: latest).")
flags.mark_flags_as_required(["workdir"])


def _usage_error(argv) -> str | None:
  if len(argv) > 1:
    return f"unexpected arguments: {' '.join(argv[1:])}"
  if (_OUT.value is None) == (_MODULES_OUT.value is None):
    return "give exactly one of --out (a Hugging Face directory) and --modules_out (an MTP modules file)"
  if _OUT.value is not None and flags.FLAGS["modules_dtype"].present:
    return "--modules_dtype applies to --modules_out only"
  return None


def main(argv):
  problem = _usage_error(argv)
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    return 2
  from mtp import cli
  if _MODULES_OUT.value is not None:
    cli.check_output_path("modules_out", _MODULES_OUT.value)
  else:
    cli.check_output_path("out", _OUT.value, "dir")
  logging.set_verbosity(logging.ERROR)   # orbax warns about read-only managers
  from mtp.checkpoint import CheckpointError
  from mtp.export import WEIGHTS_FILE, ExportError
  from mtp.export import run
  try:
    if _MODULES_OUT.value is not None:
      command = " ".join(["python -m mtp.export", *map(shlex.quote, sys.argv[1:])])
      out = run.export_modules(_WORKDIR.value, _MODULES_OUT.value, step=_STEP.value,
                               dtype=_MODULES_DTYPE.value, command=command,
                               overwrite=_OVERWRITE.value)
    else:
      out = run.export(_WORKDIR.value, _OUT.value, step=_STEP.value, overwrite=_OVERWRITE.value)
  except (ExportError, CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if _MODULES_OUT.value is not None:
    print(f"wrote {out} ({os.path.getsize(out) / 2**20:.2f} MiB)")
    return 0
  size = os.path.getsize(os.path.join(out, WEIGHTS_FILE))
  print(f"wrote {out} ({', '.join(sorted(os.listdir(out)))}; {size / 2**20:.1f} MiB of weights)")
  return 0


if __name__ == "__main__":
  from mtp.cli import main_guard, parse_flags_or_exit
  main_guard(lambda _: app.run(main, flags_parser=parse_flags_or_exit))
