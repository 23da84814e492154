r"""MTP modules for SmolLM2-135M-Instruct, end to end (``make smollm-mtp``).

    python scripts/smollm_mtp.py [--depth 1] [--features 2,15] [--data_seeds "0 1 2"] \
        [--steps 1200] [--dry_run]

Steps, each run as ``python -m ...`` with this interpreter from the
repository root (paths below are relative to it):

1. import the target into ``--base_workdir`` (runs/smollm; skipped when it
   has ``checkpoints/``: ``make smollm`` does the same);
2. import it again with ``--depth`` new MTP modules (``--mtp_init random
   --seed 0``) into ``--init_workdir`` (runs/smollm_d<depth>; skipped when it
   has ``checkpoints/``);
3. ``scripts.self_distill``: answer 1,100 training chat prompts (44 more for
   validation) at T = 0 and 1, ``--answer_batch_size`` rows at a time (auto:
   32 on the CPU, 256 on an accelerator), into ``--data_dir`` as dataset ``smollm_chat``
   (resumes an interrupted run, leaves a finished one alone);
4. the same for every seed of ``--data_seeds`` other than 0: 1,100 more
   prompts each, dataset ``smollm_chat_s<seed>``, no validation prompts;
5. ``python -m train --config configs/smollm_mtp.py:<init_workdir>`` on the
   mixture of those datasets (``data.name=smollm_chat+smollm_chat_s1+...``),
   hidden-state caches shared under ``--cache_dir`` (one per fingerprint);
   ``--steps`` overrides ``train.num_steps`` (the config's 400),
   ``--features`` sets ``mtp.feature_layers`` (EAGLE-3-style lower-layer
   features); resumes an interrupted run, leaves a finished one alone;
6. ``mtp.export --modules_out``: the trained modules into one safetensors
   file (``--overwrite``; what ``make demo`` attaches when it is
   assets/smollm2_mtp1.safetensors);
7. ``scripts/bench_chat.py``: AR vs MTP on the held-out chat prompts.

Names (as the Makefile named them): the suffix is ``_d<depth>`` unless depth
is 1, ``_fl`` with ``--features``, ``_x<n>`` with n data sets, ``_s<steps>``
with ``--steps``; the stage is runs/smollm_mtp<suffix>, the report
results/bench_chat_smollm<suffix>, the modules file
assets/smollm2_mtp<depth>[_fl][_x<n>][_s<steps>].safetensors. Extra seeds
are taken once each, in the Makefile's (lexical) order.

``--dry_run`` prints the commands as shell lines (a skippable step as
``test -d DIR/checkpoints || ...``) and runs nothing. A failing step ends the
script with its exit status. Nothing here imports JAX.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GGUF = object()   # stands for the SmolLM2 GGUF path (python -m mtp.importers.smollm)


def parse_seeds(text: str) -> list[int]:
  """Seeds separated by spaces or commas; 0 is always the first data set."""
  seeds = []
  for s in text.replace(",", " ").split():
    if not s.isdigit():
      raise ValueError(f"--data_seeds: {s!r} is not a non-negative integer")
    seeds.append(int(s))
  return seeds


def extra_seeds(seeds: list[int]) -> list[int]:
  """Seeds other than 0, each once, ordered as make's $(sort) orders them."""
  return sorted({s for s in seeds if s != 0}, key=str)


def plan(args) -> list[tuple[str | None, list]]:
  """(skip_if_dir, argv) per step; argv[0] is the interpreter."""
  py = sys.executable
  depth = args.depth
  extra = extra_seeds(args.data_seeds)
  data_x = f"_x{len(extra) + 1}" if extra else ""
  steps_x = f"_s{args.steps}" if args.steps else ""
  fl = "_fl" if args.features else ""
  suffix = ("" if depth == 1 else f"_d{depth}") + fl + data_x + steps_x
  init = args.init_workdir or f"runs/smollm_d{depth}"
  stage = args.workdir or f"runs/smollm_mtp{suffix}"
  modules = args.modules_out or f"assets/smollm2_mtp{depth}{fl}{data_x}{steps_x}.safetensors"
  bench = args.bench_out or f"results/bench_chat_smollm{suffix}"
  data_name = "+".join(["smollm_chat"] + [f"smollm_chat_s{s}" for s in extra])
  distill = [py, "-m", "scripts.self_distill", "--workdir", args.base_workdir]
  answer = ["--temperatures", "0,1", "--method", "ar", "--batch_size", str(args.answer_batch_size),
            "--max_new_tokens", "160"]
  steps = [
      (args.base_workdir, [py, "-m", "mtp.importers", "--gguf", GGUF, "--workdir", args.base_workdir]),
      (init, [py, "-m", "mtp.importers", "--gguf", GGUF, "--workdir", init, "--mtp_depth", str(depth),
              "--mtp_init", "random", "--seed", "0"]),
      (None, distill + ["--out_name", "smollm_chat", "--out_dir", args.data_dir,
                        "--chat_prompts", "1100", "--val_prompts", "44"] + answer),
  ]
  for s in extra:
    steps.append((None, distill + ["--out_name", f"smollm_chat_s{s}", "--out_dir", args.data_dir,
                                   "--chat_prompts", "1100", "--val_prompts", "0"] + answer
                  + ["--seed", str(s)]))
  train = [py, "-m", "train", "--config", f"configs/smollm_mtp.py:{init}", "--workdir", stage,
           f"--config.data.data_dir={args.data_dir}", f"--config.data.name={data_name}",
           f"--config.train.hidden_cache_dir={args.cache_dir}"]
  if args.steps:
    train.append(f"--config.train.num_steps={args.steps}")
  if args.features:
    train.append(f"--config.mtp.feature_layers={args.features}")
  steps += [
      (None, train),
      (None, [py, "-m", "mtp.export", "--workdir", stage, "--modules_out", modules, "--overwrite"]),
      (None, [py, "scripts/bench_chat.py", "--workdir", stage, "--out", bench]),
  ]
  return steps


def shell_line(skip_dir: str | None, argv: list) -> str:
  gguf = f'"$({shlex.quote(sys.executable)} -m mtp.importers.smollm)"'
  line = " ".join(gguf if a is GGUF else shlex.quote(a) for a in argv)
  if skip_dir is not None:
    line = f"test -d {shlex.quote(os.path.join(skip_dir, 'checkpoints'))} || {line}"
  return line


CPU_ANSWER_BATCH = 32          # what the committed module's data was generated with
ACCELERATOR_ANSWER_BATCH = 256  # one H200 holds it easily; AR generation is step-bound, so tok/s ~ B


def jax_backend() -> str:
  """The backend JAX would use: the first entry of ``JAX_PLATFORMS`` when set,
  otherwise asked of a JAX subprocess (this script itself never imports JAX)."""
  env = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip()
  if env:
    return env
  r = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                     cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  return r.stdout.strip() or "cpu"


def recorded_batch(data_dir: str, name: str) -> int | None:
  """The answer batch size recorded by dataset ``name`` in ``data_dir``
  (finished: ``NAME/<version>/metadata.json``; unfinished:
  ``.NAME.partial/recipe.json``), or None when there is neither."""
  finished = os.path.join(REPO, data_dir, name)
  stamps = [os.path.join(finished, v, "metadata.json")
            for v in (sorted(os.listdir(finished)) if os.path.isdir(finished) else [])]
  stamps.append(os.path.join(REPO, data_dir, f".{name}.partial", "recipe.json"))
  for path in stamps:
    try:
      with open(path) as f:
        return int(json.load(f)["recipe"]["batch_size"])
    except (OSError, ValueError, KeyError, TypeError):
      continue
  return None


def answer_batch(text: str, data_dir: str = "runs/data") -> int:
  """``--answer_batch_size``: an integer >= 1, or ``auto``: the batch size an
  existing (finished or partial) ``smollm_chat`` dataset in ``data_dir``
  recorded (the recipe, batch size included, must match for a re-run to
  reuse or resume it), else 32 on the CPU (the committed data's recipe) and
  256 on an accelerator (generation there is bound by the step's fixed
  cost, so rows are nearly free). Raises ValueError."""
  if text == "auto":
    have = recorded_batch(data_dir, "smollm_chat")
    if have is not None:
      return have
    return CPU_ANSWER_BATCH if jax_backend() == "cpu" else ACCELERATOR_ANSWER_BATCH
  if not text.isdigit() or int(text) < 1:
    raise ValueError(f"--answer_batch_size: {text!r} is not an integer >= 1 or auto")
  return int(text)


def gguf_path() -> str:
  """The GGUF file's path, from ``python -m mtp.importers.smollm`` (exits on error)."""
  r = subprocess.run([sys.executable, "-m", "mtp.importers.smollm"], cwd=REPO,
                     stdout=subprocess.PIPE, text=True)
  if r.returncode != 0:
    sys.exit(r.returncode)
  return r.stdout.strip()


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.error = lambda message: ap.exit(2, f"error: {message} (--help lists the flags)\n")  # one line
  ap.add_argument("--depth", default="1", help="MTP modules attached (D >= 1; 2 or 3: separate "
                  "modules, three draft offsets either way)")
  ap.add_argument("--features", default="", help="comma list of backbone blocks whose outputs "
                  "module 1 also reads (mtp.feature_layers), e.g. 2,15; empty: none")
  ap.add_argument("--data_seeds", default="0", help="self-distillation seeds (spaces or commas); "
                  "each seed besides 0 answers 1,100 more prompts (~30 min each here)")
  ap.add_argument("--steps", default="", help="train.num_steps (empty: the config's 400)")
  ap.add_argument("--base_workdir", default="runs/smollm", help="the imported target (D = 0)")
  ap.add_argument("--init_workdir", default="", help="target with new modules "
                  "(default runs/smollm_d<depth>)")
  ap.add_argument("--workdir", default="", help="the training stage "
                  "(default runs/smollm_mtp<suffix>)")
  ap.add_argument("--modules_out", default="", help="modules file (default "
                  "assets/smollm2_mtp<depth>[_fl][_x<n>][_s<steps>].safetensors)")
  ap.add_argument("--bench_out", default="", help="benchmark report (default "
                  "results/bench_chat_smollm<suffix>)")
  ap.add_argument("--data_dir", default="runs/data", help="self-distilled datasets")
  ap.add_argument("--answer_batch_size", default="auto", help="rows answered together by "
                  "scripts.self_distill: an integer >= 1, or auto (what an existing "
                  "smollm_chat dataset recorded, else 32 on the CPU, 256 on an accelerator)")
  ap.add_argument("--cache_dir", default="runs/hidden_caches",
                  help="hidden-state caches, one per fingerprint (train.hidden_cache_dir)")
  ap.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
  args = ap.parse_args(argv)
  try:
    if not args.depth.isdigit() or int(args.depth) < 1:
      raise ValueError(f"--depth: {args.depth!r} is not an integer >= 1")
    args.depth = int(args.depth)
    if args.steps and (not args.steps.isdigit() or int(args.steps) < 1):
      raise ValueError(f"--steps: {args.steps!r} is not an integer >= 1")
    args.steps = str(int(args.steps)) if args.steps else ""
    args.features = args.features.replace(" ", "")
    if args.features and not all(f.isdigit() for f in args.features.split(",")):
      raise ValueError(f"--features: {args.features!r} is not a comma list of block indices")
    args.data_seeds = parse_seeds(args.data_seeds)
    args.answer_batch_size = answer_batch(args.answer_batch_size, args.data_dir)
  except ValueError as e:
    ap.error(str(e))
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  steps = plan(args)
  if args.dry_run:
    for skip_dir, argv_ in steps:
      print(shell_line(skip_dir, argv_))
    return 0
  from mtp import cli
  # before any step: a given output path that cannot be written fails now (the steps run in REPO)
  for flag, kind in (("workdir", "dir"), ("modules_out", "file"), ("bench_out", "prefix"),
                     ("data_dir", "dir")):
    if getattr(args, flag):
      cli.check_output_path(flag, os.path.join(REPO, getattr(args, flag)), kind)
  gguf = None
  for skip_dir, argv_ in steps:
    if skip_dir is not None and os.path.isdir(os.path.join(REPO, skip_dir, "checkpoints")):
      print(f"skip: {os.path.join(skip_dir, 'checkpoints')} exists", file=sys.stderr, flush=True)
      continue
    if GGUF in argv_:
      gguf = gguf or gguf_path()
      argv_ = [gguf if a is GGUF else a for a in argv_]
    print("+ " + shlex.join(argv_), file=sys.stderr, flush=True)
    rc = subprocess.run(argv_, cwd=REPO).returncode
    if rc != 0:
      print(f"error: exit status {rc}: {shlex.join(argv_)}", file=sys.stderr)
      return rc
  return 0


if __name__ == "__main__":
  from mtp import cli
  cli.main_guard(main)
