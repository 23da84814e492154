"""python -m mtp.export --workdir W (--out DIR | --modules_out FILE.safetensors)
[--overwrite] [--step N] [--modules_dtype bfloat16|float32]

``--out``: writes checkpoint N (default: the latest) of workdir W as a
Hugging Face ``LlamaForCausalLM`` directory with the MTP modules under
DeepSeek-V3 naming (``mtp.export``; mapping table in docs/export.md).
``--modules_out``: writes only its MTP modules and draft vocabulary as a
small safetensors file (``mtp.export.modules``; docs/import.md), for
``python -m mtp.importers ... --mtp_modules FILE``. Parses flags and calls
``mtp.exporting``; errors (a full disk included) print one line and exit
with status 2.
"""

import contextlib
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


def check_flags_early() -> None:
  """One of --out / --modules_out, --modules_dtype with --modules_out only,
  --step >= 0: checked before jax loads. Raises ValueError, one line."""
  if (_OUT.value is None) == (_MODULES_OUT.value is None):
    raise ValueError("give exactly one of --out (a Hugging Face directory) and --modules_out "
                     "(an MTP modules file)")
  if _OUT.value is not None and flags.FLAGS["modules_dtype"].present:
    raise ValueError("--modules_dtype applies to --modules_out only")
  if _STEP.value is not None and _STEP.value < 0:
    raise ValueError(f"--step={_STEP.value} must be >= 0 (default: the latest checkpoint)")


def make_parents(path: str) -> list[str]:
  """Creates the missing folders above ``path``; returns them, outermost first."""
  made, parent = [], os.path.dirname(os.path.abspath(os.path.expanduser(path)))
  while parent and not os.path.exists(parent):
    made.insert(0, parent)
    parent = os.path.dirname(parent)
  for d in made:
    os.mkdir(d)
  return made


def main(argv):
  del argv   # flags only (mtp.cli.flags_parser)
  from mtp import cli
  if _MODULES_OUT.value is not None:
    cli.check_output_path("modules_out", _MODULES_OUT.value)
  else:
    cli.check_output_path("out", _OUT.value, "dir")
  logging.set_verbosity(logging.ERROR)   # orbax warns about read-only managers
  from mtp.checkpoint import CheckpointError
  from mtp.export import WEIGHTS_FILE, ExportError
  from mtp import exporting as run
  out = _MODULES_OUT.value or _OUT.value
  try:
    made = make_parents(out)
  except OSError as e:
    print(f"error: {'--modules_out' if _MODULES_OUT.value else '--out'}={out!r}: cannot create "
          f"its folder: {e}", file=sys.stderr)
    return 2
  try:
    if _MODULES_OUT.value is not None:
      command = " ".join(["python -m mtp.export", *map(shlex.quote, sys.argv[1:])])
      out = run.export_modules(_WORKDIR.value, _MODULES_OUT.value, step=_STEP.value,
                               dtype=_MODULES_DTYPE.value, command=command,
                               overwrite=_OVERWRITE.value)
    else:
      out = run.export(_WORKDIR.value, _OUT.value, step=_STEP.value, overwrite=_OVERWRITE.value)
  except (ExportError, CheckpointError) as e:
    for d in reversed(made):   # nothing left behind by a failed export
      with contextlib.suppress(OSError):
        os.rmdir(d)
    print(f"error: {e}", file=sys.stderr)
    return 2
  if _MODULES_OUT.value is not None:
    print(f"wrote {out} ({os.path.getsize(out) / 2**20:.2f} MiB)")
    return 0
  size = os.path.getsize(os.path.join(out, WEIGHTS_FILE))
  print(f"wrote {out} ({', '.join(sorted(os.listdir(out)))}; {size / 2**20:.1f} MiB of weights)")
  return 0


if __name__ == "__main__":
  from mtp.cli import flags_parser, main_guard
  main_guard(lambda _: app.run(main, flags_parser=flags_parser(check_flags_early)))
