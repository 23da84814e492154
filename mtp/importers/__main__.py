"""python -m mtp.importers (--gguf FILE | --hf DIR) --workdir DIR
[--dtype float32|bfloat16] [--mtp_depth D] [--mtp_init random|last_block]
[--mtp_init_scale S] [--seed S] [--never_emitted IDS]
[--mtp_modules FILE.safetensors [--allow_other_target]]

Imports a pretrained Llama-family model into a new workdir (see
``mtp.importers``); ``--mtp_modules`` attaches trained MTP modules from a
modules file (``python -m mtp.export --modules_out``; ``mtp.importers.attach``)
instead of new ones. Parses flags and calls the library; an error is one
line on stderr (exit status 2) and nothing is written.
"""

from __future__ import annotations

import argparse
import sys

# New-module options (None = not given): --mtp_modules excludes them.
_NEW_MODULE_DEFAULTS = {"mtp_depth": 0, "mtp_init": "random", "mtp_init_scale": 1.0, "seed": 0}
MAX_MTP_DEPTH = 16   # mtp.config: mtp.depth in [0, 16]


def _parser() -> argparse.ArgumentParser:
  from mtp.cli import OneLineParser
  p = OneLineParser(prog="python -m mtp.importers", description=__doc__.split("\n\n")[1])
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--gguf", help="a llama.cpp GGUF file (llama architecture)")
  src.add_argument("--hf", help="a Hugging Face LlamaForCausalLM / MistralForCausalLM directory")
  p.add_argument("--workdir", required=True, help="new (absent or empty) output workdir")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--mtp_depth", type=int, default=None, help="D new MTP modules (default 0)")
  p.add_argument("--mtp_init", default=None, choices=("random", "last_block"),
                 help="new modules: random (default; from --seed) or last_block (a copy of the "
                      "last backbone block, final-norm weights, projection [s*I, 0] passing h "
                      "through)")
  p.add_argument("--mtp_init_scale", type=float, default=None,
                 help="s of --mtp_init=last_block's projection [s*I, 0] (default 1)")
  p.add_argument("--seed", type=int, default=None,
                 help="initialisation seed of the new MTP modules (default 0)")
  p.add_argument("--mtp_modules", default=None,
                 help="attach the trained MTP modules (and draft vocabulary) of this modules file "
                      "(python -m mtp.export --modules_out); excludes the new-module options")
  p.add_argument("--allow_other_target", action="store_true",
                 help="with --mtp_modules: attach them even when the target's backbone is not "
                      "the one they were trained against (fingerprint differs)")
  p.add_argument("--never_emitted", default=None,
                 help="comma-separated ids the head never emits (default: PAD when distinct "
                      "from EOS, else none); '' for none")
  return p


def check_flags_early(ap: argparse.ArgumentParser, args) -> None:
  """The ranges the importers check later, before jax loads: ``ap.error``
  (one line naming the flag; exit status 2)."""
  import math
  if args.mtp_depth is not None and not 0 <= args.mtp_depth <= MAX_MTP_DEPTH:
    ap.error(f"--mtp_depth={args.mtp_depth}: must be in [0, {MAX_MTP_DEPTH}] (mtp.depth)")
  scale = args.mtp_init_scale
  if scale is not None and not (math.isfinite(scale) and scale > 0):
    ap.error(f"--mtp_init_scale={scale!r}: must be a finite number > 0")


def main(argv=None) -> int:
  ap = _parser()
  args = ap.parse_args(argv)
  check_flags_early(ap, args)
  from mtp.cli import check_output_path
  check_output_path("workdir", args.workdir, "dir")
  from mtp.config import ConfigError, parse_id_list
  from mtp.importers import ModelImportError
  from mtp.importers.attach import check_exclusive
  given = [f"--{k}" for k in _NEW_MODULE_DEFAULTS if getattr(args, k) is not None]
  new = {k: d if getattr(args, k) is None else getattr(args, k)
         for k, d in _NEW_MODULE_DEFAULTS.items()}
  try:
    check_exclusive(args.mtp_modules, given)
    if args.allow_other_target and not args.mtp_modules:
      raise ModelImportError("--allow_other_target needs --mtp_modules")
    never = None if args.never_emitted is None else parse_id_list(args.never_emitted,
                                                                   "--never_emitted")
    kw = dict(dtype=args.dtype, never_emitted=never, mtp_modules=args.mtp_modules,
              allow_other_target=args.allow_other_target, **new)
    if args.gguf:
      from mtp.importers.gguf import import_gguf
      out = import_gguf(args.gguf, args.workdir, **kw)
    else:
      from mtp.importers.hf import import_hf_dir
      out = import_hf_dir(args.hf, args.workdir, **kw)
  except (ModelImportError, ConfigError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"imported into {out}" + (f" with the MTP modules of {args.mtp_modules}"
                                  if args.mtp_modules else ""))
  return 0


if __name__ == "__main__":
  from mtp.cli import main_guard
  main_guard(main)
