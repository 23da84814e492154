"""python -m mtp.importers (--gguf FILE | --hf DIR) --workdir DIR
[--dtype float32|bfloat16] [--mtp_depth D] [--mtp_init random|last_block]
[--mtp_init_scale S] [--seed S] [--never_emitted IDS]

Imports a pretrained Llama-family model into a new workdir (see
``mtp.importers``). Parses flags and calls the library; an error is one line
on stderr (exit status 2) and nothing is written.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m mtp.importers", description=__doc__.split("\n\n")[1])
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--gguf", help="a llama.cpp GGUF file (llama architecture)")
  src.add_argument("--hf", help="a Hugging Face LlamaForCausalLM / MistralForCausalLM directory")
  p.add_argument("--workdir", required=True, help="new (absent or empty) output workdir")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--mtp_depth", type=int, default=0, help="D new MTP modules")
  p.add_argument("--mtp_init", default="random", choices=("random", "last_block"),
                 help="new modules: random (from --seed) or last_block (a copy of the last "
                      "backbone block, final-norm weights, projection [s*I, 0] passing h through)")
  p.add_argument("--mtp_init_scale", type=float, default=1.0,
                 help="s of --mtp_init=last_block's projection [s*I, 0]")
  p.add_argument("--seed", type=int, default=0, help="initialisation seed of the MTP modules")
  p.add_argument("--never_emitted", default=None,
                 help="comma-separated ids the head never emits (default: PAD when distinct "
                      "from EOS, else none); '' for none")
  args = p.parse_args(argv)
  from mtp.config import ConfigError, parse_id_list
  from mtp.importers import ModelImportError
  try:
    never = None if args.never_emitted is None else parse_id_list(args.never_emitted,
                                                                   "--never_emitted")
    if args.gguf:
      from mtp.importers.gguf import import_gguf
      out = import_gguf(args.gguf, args.workdir, dtype=args.dtype, mtp_depth=args.mtp_depth,
                        seed=args.seed, never_emitted=never,
                        mtp_init=args.mtp_init, mtp_init_scale=args.mtp_init_scale)
    else:
      from mtp.importers.hf import import_hf_dir
      out = import_hf_dir(args.hf, args.workdir, dtype=args.dtype, mtp_depth=args.mtp_depth,
                          seed=args.seed, never_emitted=never,
                        mtp_init=args.mtp_init, mtp_init_scale=args.mtp_init_scale)
  except (ModelImportError, ConfigError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"imported into {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
