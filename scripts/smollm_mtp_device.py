r"""One command for an accelerator run of the MTP-module recipe for
SmolLM2-135M-Instruct, inside a wall-clock budget (``make smollm-mtp-device``).

    python -m scripts.smollm_mtp_device [--budget_s 480] [--gen_share 0.5] [--eval_s 60] \
        [--batch_size auto] [--prompts 65536] [--steps auto] [--train_batch auto] \
        [--base_workdir runs/smollm] [--workdir runs/smollm_mtp_device] [--data_dir runs/data] \
        [--out results/smollm_mtp_device] [--quick]

Steps (each one resumes; issue 43 item 3):

1. the target with ``--depth`` new MTP modules: ``--init_workdir``
   (runs/smollm_d<depth>, the one ``scripts/smollm_mtp.py`` makes: imported
   again from the file ``--base_workdir``'s ``import.json`` names, random
   modules, seed 0; reused when it has ``checkpoints/``);
2. self-distilled answers of the target (``scripts.self_distill``'s
   ``make_chat_dataset``, in this process, AR at T = 0 and 1 as
   ``make smollm-mtp``) at batch ``--batch_size`` (auto: 256 on an accelerator,
   32 on the CPU), written in parts of ``--chunk_prompts`` prompts (datasets
   ``<name>_p0``, ``_p1``, ...; seed ``--seed + k``; part 0 also holds the
   ``--val_prompts`` validation answers) until ``--prompts`` are answered or the
   generation share of the budget (``--gen_share``) is spent: a part starts
   only when the previous one's wall time still fits. ``--self_prompts FILE
   --self_prompt_share S``: that share of each part's prompts from a
   self-written prompt file (``scripts/self_prompts.py``), a different slice
   of the file per part. Templated prompts are drawn per part (seed + k) and
   repeat across parts: their 'general' category holds ~230 distinct
   prompts, one in 11 of each part, so past a few parts the diversity comes
   from the other categories and from self-written prompts;
3. training of the modules (``configs/smollm_mtp.py`` on the step-1 workdir,
   through ``train.loop.train``, the path of ``python -m train``) with the
   frozen backbone computed on the fly (``train.hidden_cache=False``), in
   bfloat16 activations on an accelerator (``model.dtype``; ``--dtype``), on
   the mixture of the parts, into ``--workdir``, with evaluations and
   checkpoints every num_steps / ``--evals`` steps. ``--steps auto``: a short
   calibration run (``CAL_WINDOWS`` log windows of ``CAL_LOG_EVERY`` steps,
   stopped with a checkpoint) measures the step time, and num_steps is what
   the rest of the training share holds (``steps_for_budget``); training
   stops at the end of the share in any case (``train.loop.train``'s
   ``deadline``: a checkpoint at the first log step past it);
4. held-out agreement: alpha per draft position (G = the trained offsets)
   and tau per category of the held-out chat prompts (``mtp/data/heldout_chat.jsonl``,
   ``scripts.bench_chat.heldout_prompts``) at ``--temperatures``, float32,
   one batch per temperature (``decode.cli.stats.summarize_by_category``);
5. ``mtp.export`` ``--modules_out`` (bfloat16; checked < 16 MB) and the report
   ``OUT.json``: the curve (step, wall time, train loss, validation agreement
   per position), held-out alpha per category, the budget split and its use,
   provenance (commit, jax version, backend, device kind, date).

Resume: the plan (parts, num_steps) and what finished are kept in
``WORKDIR/device_run.json``. Re-running with the same arguments keeps the
finished parts (a cut-off part resumes from its saved batches), resumes
training from the workdir's checkpoint up to the planned num_steps, and a
finished run only re-reports (nothing generated, trained, evaluated or
exported again). Other recipe arguments with an existing run are refused;
the budget may differ (each invocation honours its own).

``--quick``: tiny sizes for a CPU smoke run (CI, with a tiny imported target
given as ``--base_workdir``); writes under runs/quick/ unless ``--out``.
Exit status: 0 done, 2 bad flags or inputs (one line: an output path that
cannot be written is found before any work; a --workdir another run holds;
a full disk), 1 a modules file of 16 MB or more, 128 + signal when a user's
signal stopped training, 130 for a Ctrl-C at any other time (one line).
"""

from __future__ import annotations

import time

START = time.monotonic()       # the budget counts from here, before JAX is imported

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:   # imported for annotations only: JAX loads after START
  from train.loop import TrainResult

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATE_FILE = "device_run.json"          # in --workdir: the plan and what finished
MODULES_LIMIT_BYTES = 16 * 2 ** 20
CAL_LOG_EVERY = 5                       # calibration: log windows of this many steps,
CAL_WINDOWS = 3                         # the first (compiling) one untimed
STEP_SAFETY = 0.9                       # share of the estimated steps planned
# mtp.data.chat_prompts draws every 11th prompt from the 'general' category, which holds
# ~230 distinct training and ~28 validation prompts: a part of more than ~2,400 prompts (or
# more than ~250 validation prompts) cannot be filled without repeats, and it raises
MAX_PART_PROMPTS = 2048
MAX_VAL_PROMPTS = 256
ACCEL_DEFAULTS = {"batch_size": 256, "train_batch": 64, "dtype": "bfloat16"}
CPU_DEFAULTS = {"batch_size": 32, "train_batch": 8, "dtype": "float32"}
# what makes a run: another value with an existing run is refused (the budget may differ)
RECIPE_KEYS = ("base_workdir", "init_workdir", "depth", "name", "data_dir", "prompts",
               "chunk_prompts", "val_prompts", "max_new_tokens", "gen_temperatures",
               "batch_size", "seed", "self_prompts", "self_prompt_share", "steps",
               "train_batch", "seq_len", "draft_vocab_size", "dtype", "divergence", "evals")


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def elapsed() -> float:
  """Seconds since this command started."""
  return time.monotonic() - START


# -- flags ---------------------------------------------------------------------------------

class OneLineParser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are one line ``error: ...`` on stderr
  and exit status 2 (no usage block), so ``mtp.cli``'s validators
  (``check_range``, ``parse_list``), which call ``ap.error``, fail in one line."""

  def error(self, message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def auto_int(ap, flag: str, text, lo: int, hi: int) -> int | None:
  """``--flag``'s value: None for "auto", else an integer in [lo, hi];
  ``ap.error`` naming the flag and the range otherwise."""
  if str(text).strip() == "auto":
    return None
  try:
    v = int(str(text).strip())
  except ValueError:
    v = None
  if v is None or not lo <= v <= hi:
    ap.error(f"--{flag}={text!r}: must be auto or an integer in [{lo}, {hi}]")
  return v


def parse_args(argv=None):
  """Parses and validates the flags (module docstring); a bad value exits 2
  with one line naming the flag and its allowed range. "auto" values stay
  None here (``resolve_auto`` fills them once the backend is known)."""
  from mtp import cli
  ap = OneLineParser(prog="python -m scripts.smollm_mtp_device", description=__doc__,
                     formatter_class=cli.HelpFormatter)
  ap.add_argument("--budget_s", type=float, default=480.0,
                  help="wall-clock seconds for the whole run, in [20, 86400]")
  ap.add_argument("--gen_share", type=float, default=0.5,
                  help="share of the budget for generating answers, in [0.05, 0.9]")
  ap.add_argument("--eval_s", type=float, default=60.0,
                  help="seconds kept for the held-out evaluation and the export, in [0, 3600]")
  ap.add_argument("--base_workdir", default="runs/smollm",
                  help="the imported target, D = 0 (make smollm)")
  ap.add_argument("--init_workdir", default="",
                  help="the target with new MTP modules (default runs/smollm_d<depth>)")
  ap.add_argument("--workdir", default="runs/smollm_mtp_device", help="the training stage")
  ap.add_argument("--data_dir", default="runs/data", help="self-distilled datasets")
  ap.add_argument("--name", default="smollm_dev",
                  help="dataset name prefix (parts NAME_p0, NAME_p1, ...)")
  ap.add_argument("--out", default="results/smollm_mtp_device", help="report prefix (OUT.json)")
  ap.add_argument("--modules_out", default="",
                  help="modules file (default assets/smollm2_mtp<depth>_device.safetensors)")
  ap.add_argument("--depth", type=int, default=1, help="MTP modules D, in [1, 3]")
  ap.add_argument("--batch_size", default="auto",
                  help="answer rows decoded together: auto (256 on an accelerator, 32 on the "
                       "CPU) or an integer in [1, 4096]")
  ap.add_argument("--prompts", type=int, default=65536,
                  help="most training prompts answered, in [1, 4194304]")
  ap.add_argument("--chunk_prompts", default="auto",
                  help="prompts per dataset part: auto (8 x --batch_size, at most 2048) or an "
                       "integer in [1, 2048] (the templated 'general' category runs out above)")
  ap.add_argument("--val_prompts", type=int, default=64,
                  help="validation prompts (part 0), in [1, 256]")
  ap.add_argument("--max_new_tokens", type=int, default=160,
                  help="answer tokens at most, in [1, 4096]")
  ap.add_argument("--gen_temperatures", default="0,1",
                  help="answer temperatures (prompt i at the (i mod k)-th), each in [0, 100]")
  ap.add_argument("--seed", type=int, default=0, help="data seed (part k: seed + k), >= 0")
  ap.add_argument("--self_prompts", default="",
                  help="a self-written prompt file (python -m scripts.self_prompts)")
  ap.add_argument("--self_prompt_share", type=float, default=0.0,
                  help="share of each part's prompts from --self_prompts, in [0, 1]")
  ap.add_argument("--steps", default="auto",
                  help="train.num_steps: auto (what the training share holds, measured) or an "
                       "integer in [1, 10000000]")
  ap.add_argument("--train_batch", default="auto",
                  help="train.batch_size: auto (64 on an accelerator, 8 on the CPU) or an "
                       "integer in [1, 4096]")
  ap.add_argument("--seq_len", type=int, default=512, help="train.seq_len, in [16, 8192]")
  ap.add_argument("--draft_vocab_size", type=int, default=4096,
                  help="mtp.draft_vocab_size (0: the full vocabulary), in [0, 1048576]")
  ap.add_argument("--dtype", default="auto",
                  help="activation dtype of training: auto (bfloat16 on an accelerator, "
                       "float32 on the CPU), float32 or bfloat16")
  ap.add_argument("--divergence", default="kl", choices=("kl", "tv", "mix"),
                  help="mtp.distill_divergence")
  ap.add_argument("--evals", type=int, default=10,
                  help="evaluations (and checkpoints) during training, in [1, 1000]")
  ap.add_argument("--temperatures", default="0,1",
                  help="held-out evaluation temperatures, each in [0, 100]")
  ap.add_argument("--heldout_per_category", type=int, default=10,
                  help="held-out prompts per category, in [1, 1000]")
  ap.add_argument("--heldout_max_new_tokens", type=int, default=128,
                  help="new tokens per held-out prompt, in [1, 4096]")
  ap.add_argument("--stop_after_step", type=int, default=0,
                  help="stop training after this step as an interruption would (tests; 0: "
                       "never), >= 0")
  ap.add_argument("--quick", action="store_true",
                  help="tiny sizes for a CPU smoke run; writes under runs/quick/ unless --out")
  args = ap.parse_args(argv)
  if args.quick:
    cli.apply_quick(ap, args, budget_s=45.0, gen_share=0.3, eval_s=10.0, batch_size="4",
                    prompts=8, chunk_prompts="8", steps="12", val_prompts=4, max_new_tokens=8,
                    train_batch="4", seq_len=256, draft_vocab_size=64, evals=3,
                    heldout_per_category=1, heldout_max_new_tokens=8,
                    workdir=os.path.join(cli.QUICK_OUT_DIR, "smollm_mtp_device"),
                    data_dir=os.path.join(cli.QUICK_OUT_DIR, "data"),
                    modules_out=os.path.join(cli.QUICK_OUT_DIR, "smollm2_mtp_device.safetensors"))
  cli.check_range(ap, args, budget_s=(20, 86400), gen_share=(0.05, 0.9), eval_s=(0, 3600),
                  depth=(1, 3), prompts=(1, 1 << 22), val_prompts=(1, MAX_VAL_PROMPTS),
                  max_new_tokens=(1, 4096), seed=0, self_prompt_share=(0, 1),
                  seq_len=(16, 8192), draft_vocab_size=(0, 1 << 20), evals=(1, 1000),
                  heldout_per_category=(1, 1000), heldout_max_new_tokens=(1, 4096),
                  stop_after_step=0)
  train_s = args.budget_s * (1 - args.gen_share) - args.eval_s
  if train_s < 5:
    ap.error(f"--eval_s={args.eval_s:g}: leaves {train_s:.0f} s of --budget_s={args.budget_s:g} "
             f"x (1 - --gen_share={args.gen_share:g}) for training; must leave >= 5 s")
  if args.self_prompt_share > 0 and not args.self_prompts:
    ap.error(f"--self_prompt_share={args.self_prompt_share:g}: needs --self_prompts FILE")
  if args.dtype not in ("auto", "float32", "bfloat16"):
    ap.error(f"--dtype={args.dtype!r}: must be one of auto, float32, bfloat16")
  if not re.fullmatch(r"[a-z][a-z0-9_]*", args.name):
    ap.error(f"--name={args.name!r}: must be snake_case (a-z, 0-9, _; a letter first)")
  args.batch_size = auto_int(ap, "batch_size", args.batch_size, 1, 4096)
  args.chunk_prompts = auto_int(ap, "chunk_prompts", args.chunk_prompts, 1, MAX_PART_PROMPTS)
  args.steps = auto_int(ap, "steps", args.steps, 1, 10_000_000)
  args.train_batch = auto_int(ap, "train_batch", args.train_batch, 1, 4096)
  args.gen_temperatures = cli.parse_list(ap, "gen_temperatures", args.gen_temperatures, float,
                                         0, 100)
  args.temperatures = cli.parse_list(ap, "temperatures", args.temperatures, float, 0, 100)
  args.init_workdir = args.init_workdir or f"runs/smollm_d{args.depth}"
  args.modules_out = args.modules_out or f"assets/smollm2_mtp{args.depth}_device.safetensors"
  return args


def resolve_auto(args, backend: str):
  """Fills the "auto" flags for ``backend`` (jax.default_backend()):
  ``ACCEL_DEFAULTS`` on an accelerator, ``CPU_DEFAULTS`` on the CPU;
  chunk_prompts = 8 x batch_size, at most ``MAX_PART_PROMPTS``. Returns ``args``."""
  d = CPU_DEFAULTS if backend == "cpu" else ACCEL_DEFAULTS
  args.batch_size = args.batch_size or d["batch_size"]
  args.train_batch = args.train_batch or d["train_batch"]
  args.dtype = d["dtype"] if args.dtype == "auto" else args.dtype
  args.chunk_prompts = args.chunk_prompts or min(8 * args.batch_size, MAX_PART_PROMPTS)
  return args


def recipe_of(args) -> dict:
  """The arguments that make a run (``RECIPE_KEYS``), JSON-comparable."""
  return json.loads(json.dumps({k: getattr(args, k) for k in RECIPE_KEYS}))


# -- pure planning ---------------------------------------------------------------------------

def part_sizes(prompts: int, chunk: int) -> list[int]:
  """Prompts per dataset part: ``prompts`` in parts of ``chunk`` (the last
  one smaller). Example: ``part_sizes(20, 8) == [8, 8, 4]``."""
  return [min(chunk, prompts - s) for s in range(0, prompts, chunk)]


def part_fits(now: float, deadline: float, last_part_s: float | None) -> bool:
  """Whether another part starts: always when none has been timed yet, else
  when the last part's wall time (seconds) fits before ``deadline``."""
  return last_part_s is None or now + last_part_s <= deadline


def steps_for_budget(seconds: float, step_s: float, overhead_s: float,
                     safety: float = STEP_SAFETY) -> int:
  """Train steps that fit ``seconds``: ``safety`` x (seconds - overhead_s) /
  step_s, at least 1 (overhead_s: start-up and compilation of the run;
  step_s > 0 seconds per step). Example: ``steps_for_budget(100, 0.1, 10)
  == 810``."""
  if not step_s > 0:
    raise ValueError(f"step_s={step_s!r} must be > 0")
  return max(1, int(safety * max(seconds - overhead_s, 0.0) / step_s))


def self_prompt_slice(prompts: list, k: int, n: int) -> list:
  """Part k's ``n`` self-written prompts: items [k n, (k + 1) n) of
  ``prompts``, cycling past the end (so parts differ while the file lasts)."""
  if not prompts or n <= 0:
    return []
  return [prompts[(k * n + i) % len(prompts)] for i in range(n)]


STEP_LINE = re.compile(r"^step (\d+)[/:]")


def curve(metrics_rows: list[dict], stamps: dict, positions: int) -> list[dict]:
  """The training curve: one row per logged step of ``metrics_rows`` (the
  stage's metrics.jsonl rows; for a step logged twice the later row wins)
  with ``step``, ``run`` and ``wall_s`` (``stamps[str(step)]`` = [invocation
  index, seconds since that invocation started], None when unseen),
  ``train_loss`` (None without a train row), ``agreement`` and ``accuracy``
  ([positions] validation teacher agreement and top-1 accuracy of draft
  positions 1..positions, None without an eval row)."""
  by_step: dict[int, dict] = {}
  for r in metrics_rows:
    if isinstance(r, dict) and r.get("split") in ("train", "eval") and "step" in r:
      by_step.setdefault(int(r["step"]), {})[r["split"]] = r
  out = []
  for step in sorted(by_step):
    tr, ev = by_step[step].get("train"), by_step[step].get("eval")
    run, wall = stamps.get(str(step), [None, None])
    get = lambda key: [ev.get(f"mtp_{k}/{key}") for k in range(1, positions + 1)] if ev else None
    out.append({"step": step, "run": run, "wall_s": wall,
                "train_loss": tr.get("loss") if tr else None,
                "agreement": get("teacher_agreement"), "accuracy": get("accuracy")})
  return out


# -- state -----------------------------------------------------------------------------------

def read_state(workdir: str) -> dict | None:
  path = os.path.join(workdir, STATE_FILE)
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def write_state(workdir: str, state: dict) -> None:
  """Writes the state atomically (``mtp.cli.write_atomic``)."""
  from mtp.files import write_atomic
  os.makedirs(workdir, exist_ok=True)
  write_atomic(os.path.join(workdir, STATE_FILE), json.dumps(state, indent=1))


# -- step 1: the target with new modules ---------------------------------------------------

def ensure_init_workdir(base: str, init: str, depth: int) -> str:
  """``init``: the target of ``base`` with ``depth`` new random MTP modules
  (seed 0), imported again from the file ``base/import.json`` names (as
  ``scripts/smollm_mtp.py`` step 2 does); an existing ``init`` with a
  checkpoint is used as it is when its depth is ``depth``. Raises
  CheckpointError (no ``base``, or ``init`` of another depth),
  ModelImportError."""
  from mtp import loading
  from mtp.checkpoint import CheckpointError
  from mtp.importers import IMPORT_FILE
  if os.path.isdir(os.path.join(init, "checkpoints")):
    cfg, _ = loading.load_config(init)
    if cfg.mtp.depth != depth:
      raise CheckpointError(f"--init_workdir={init!r} has mtp.depth={cfg.mtp.depth}, not "
                            f"--depth={depth}; give another --init_workdir")
    return init
  if not os.path.isdir(os.path.join(base, "checkpoints")):
    raise CheckpointError(f"--base_workdir={base!r} has no checkpoint: import the target first "
                          "(make smollm)")
  try:
    with open(os.path.join(base, IMPORT_FILE), encoding="utf-8") as f:
      prov = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"--base_workdir={base!r}: cannot read its {IMPORT_FILE} ({e}); "
                          "give --init_workdir with the modules attached") from None
  src, fmt = prov.get("source"), prov.get("format")
  log(f"[init] importing {src} ({fmt}) with {depth} new MTP module(s) into {init}")
  kw = dict(mtp_depth=depth, mtp_init="random", seed=0, dtype=prov.get("dtype") or "float32")
  if fmt == "gguf":
    from mtp.importers.gguf import import_gguf
    return import_gguf(src, init, **kw)
  if fmt == "hf":
    from mtp.importers.hf import import_hf_dir
    return import_hf_dir(src, init, **kw)
  raise CheckpointError(f"--base_workdir={base!r}: {IMPORT_FILE} names format {fmt!r}, not gguf "
                        "or hf; give --init_workdir with the modules attached")


# -- step 2: answers -------------------------------------------------------------------------

def part_recipe(args, k: int, n: int):
  """Part k's ``scripts.self_distill.ChatRecipe`` (n training prompts; part
  0 also the validation prompts; seed + k; a slice of the self-written
  prompts written next to the datasets)."""
  from mtp.data import chat as chat_lib
  from mtp.data import self_prompts as sp_lib
  from scripts import self_distill as sd
  kw = {}
  if args.self_prompt_share > 0:
    n_self = math.ceil(args.self_prompt_share * n)   # mix_prompt_sources never asks for more
    path = os.path.abspath(os.path.join(args.data_dir, f"{args.name}_p{k}.self_prompts.jsonl"))
    if not os.path.isfile(path):
      rows = chat_lib.read_prompt_jsonl(args.self_prompts, what="--self_prompts file")
      os.makedirs(os.path.dirname(path), exist_ok=True)
      sp_lib.write_prompt_jsonl(path, self_prompt_slice(rows, k, n_self))
    kw = dict(self_prompts=path, self_prompt_share=args.self_prompt_share)
  return sd.ChatRecipe(chat_prompts=n, val_prompts=args.val_prompts if k == 0 else 0,
                       temperatures=tuple(args.gen_temperatures), max_new_tokens=args.max_new_tokens,
                       method="ar", batch_size=args.batch_size, seed=args.seed + k, **kw)


def generate(args, state: dict, deadline: float, save) -> list[str]:
  """Answers prompts in parts until ``--prompts`` are answered or a part no
  longer fits before ``deadline`` (monotonic seconds since START); part 0
  always. Returns the parts' dataset names. Finished parts of an earlier
  invocation are kept; a cut-off part resumes from its saved batches."""
  from scripts import self_distill as sd
  g = state.setdefault("generation", {"parts": [], "done": False})
  if g["done"]:
    log(f"[generate] done in an earlier run: {len(g['parts'])} part(s)")
    return [p["name"] for p in g["parts"]]
  sizes = part_sizes(args.prompts, args.chunk_prompts)
  last_s = g["parts"][-1]["wall_s"] if g["parts"] else None
  for k in range(len(g["parts"]), len(sizes)):
    if k and not part_fits(elapsed(), deadline, last_s):
      g["stopped_by_budget"] = True
      log(f"[generate] {k} part(s): the next needs ~{last_s:.0f} s, "
          f"{max(deadline - elapsed(), 0):.0f} s of the generation share left")
      break
    name = f"{args.name}_p{k}"
    t0 = time.monotonic()
    meta = sd.make_chat_dataset(args.init_workdir, name, part_recipe(args, k, sizes[k]),
                                data_dir=args.data_dir, out_dir=args.data_dir, log=log)
    # a part found finished (written, then the process died before the state was saved)
    # keeps the wall time of the run that made it, so the next part's fit check stays real
    wall = meta.get("wall_s", 0.0) if meta.get("skipped") else time.monotonic() - t0
    split = meta["splits"]["train"]
    g["parts"].append({"name": name, "prompts": split["prompts"],
                       "answer_tokens": split["answer_tokens"],
                       "wall_s": round(wall, 2), "existed": bool(meta.get("skipped"))})
    last_s = wall
    save()
  g["done"] = True
  save()
  return [p["name"] for p in g["parts"]]


# -- step 3: training ------------------------------------------------------------------------

def stage_config(args, data_names: list[str], *, num_steps: int, log_every: int,
                 eval_every: int, warmup_steps: int | None = None):
  """The stage's ``Config``: ``configs/smollm_mtp.py`` on the init workdir
  with the frozen backbone on the fly (no hidden-state cache), the parts'
  mixture, this run's sizes, dtype and divergence; checkpoints with every
  evaluation. Raises ConfigError."""
  from mtp import config as config_lib
  c = config_lib.read_config_file(os.path.join(REPO, "configs", "smollm_mtp.py") + ":"
                                  + args.init_workdir)
  c.data.name = "+".join(data_names)
  c.data.data_dir = os.path.abspath(args.data_dir)
  c.train.freeze_backbone = True
  c.train.hidden_cache = False
  c.train.num_steps = num_steps
  c.train.batch_size = args.train_batch
  c.train.seq_len = args.seq_len
  c.train.log_every = log_every
  c.train.eval_every = eval_every
  if warmup_steps is not None:
    c.train.warmup_steps = warmup_steps
  c.checkpoint.every_steps = eval_every
  c.checkpoint.keep = 2
  c.model.dtype = args.dtype
  c.mtp.draft_vocab_size = args.draft_vocab_size
  c.mtp.distill_divergence = args.divergence
  return config_lib.from_dict(c)


class _NoTTY:
  """A stream proxy that says it is not a terminal: the train loop's
  progress bar stays off and it logs one line per log window instead
  (which ``StampLog`` times)."""

  def __init__(self, stream):
    self._s = stream

  def isatty(self):
    return False

  def __getattr__(self, name):
    return getattr(self._s, name)


class StampLog:
  """The train loop's ``log``: prints each line and records when a line
  naming a step ("step N/M: ..." or "step N: eval ...") was seen, as
  ``stamps[str(N)] = [run, seconds since START]``."""

  def __init__(self, stamps: dict, run: int):
    self.stamps, self.run = stamps, run

  def __call__(self, line: str) -> None:
    m = STEP_LINE.match(line)
    if m:
      self.stamps[m.group(1)] = [self.run, round(elapsed(), 2)]
    log(line)


def latest_step(workdir: str) -> int:
  """The stage's latest checkpoint step (0 without one)."""
  from mtp import checkpoint as ckpt_lib
  if not os.path.isdir(ckpt_lib.checkpoint_dir(workdir)):
    return 0
  ckpt = ckpt_lib.Checkpointer(workdir, read_only=True)
  try:
    return int(ckpt.latest_step() or 0)
  finally:
    ckpt.close()


def run_train(cfg, workdir: str, stamps: dict, run: int, deadline: float | None,
              stop_after: int | None) -> tuple[TrainResult, bool]:
  """``train.loop.train(cfg, workdir)`` with step lines timed, the bar off
  and (``deadline``: seconds since START) the loop's own deadline: it stops
  at the first log step past it with a checkpoint, as a signal would.
  Returns (its result, whether the deadline stopped it)."""
  from train import loop
  at = None if deadline is None else START + deadline
  with contextlib.redirect_stderr(_NoTTY(sys.stderr)):
    result = loop.train(cfg, workdir, log=StampLog(stamps, run), stop_after=stop_after,
                        deadline=at)
  return result, result.deadline_reached


def train_phase(args, state: dict, data_names: list[str], deadline: float, run: int,
                save) -> dict:
  """Plans num_steps (``--steps`` or a calibration run and
  ``steps_for_budget``) once, then trains to it or to ``deadline``. Returns
  the state's "train" entry; exits 128 + signal when a user's signal
  stopped the run (checkpoint saved: a re-run resumes)."""
  from mtp import cli
  t = state.setdefault("train", {"done": False})
  stamps = state.setdefault("stamps", {})
  if t["done"]:
    log(f"[train] done in an earlier run at step {t.get('step')}")
    return t
  base_warmup = stage_config(args, data_names, num_steps=10 ** 6, log_every=1,
                             eval_every=10 ** 6).train.warmup_steps
  if not t.get("num_steps"):
    if args.steps:
      t["num_steps"] = args.steps
    else:
      start = latest_step(args.workdir)
      cal = CAL_LOG_EVERY * CAL_WINDOWS
      cfg = stage_config(args, data_names, num_steps=10 ** 6, log_every=CAL_LOG_EVERY,
                         eval_every=10 ** 6)
      log(f"[train] calibration: {cal} steps from step {start}")
      t0 = time.monotonic()
      result, _ = run_train(cfg, args.workdir, stamps, run, None, start + cal)
      wall = time.monotonic() - t0
      if result.interrupted:         # a user's signal: nothing planned, a re-run calibrates
        cli.exit_if_interrupted(result.as_dict(), start + cal, "calibration", args.workdir)
      step_s = result.step_time_s or wall / max(result.step - start, 1)
      overhead = max(wall - (result.step - start) * step_s, 0.0)
      more = steps_for_budget(deadline - elapsed(), step_s, overhead)
      t["num_steps"] = result.step + more
      t["calibration"] = {"steps": result.step - start, "wall_s": round(wall, 2),
                          "step_time_s": step_s, "overhead_s": round(overhead, 2),
                          "train_s_left": round(deadline - elapsed(), 2)}
      log(f"[train] calibration: {step_s * 1e3:.1f} ms/step, {overhead:.0f} s start-up: "
          f"num_steps {t['num_steps']}")
    save()
  n = t["num_steps"]
  every = max(1, n // args.evals)
  warmup = min(base_warmup, max(1, n // 4))
  cfg = stage_config(args, data_names, num_steps=n, log_every=max(1, min(10, every)),
                     eval_every=every, warmup_steps=warmup)
  t["config"] = {"num_steps": n, "batch_size": cfg.train.batch_size, "seq_len": cfg.train.seq_len,
                 "learning_rate": cfg.train.learning_rate, "warmup_steps": warmup,
                 "dtype": cfg.model.dtype, "draft_vocab_size": cfg.mtp.draft_vocab_size,
                 "distill_divergence": cfg.mtp.distill_divergence, "eval_every": every,
                 "depth": cfg.mtp.depth, "recursive_steps": cfg.mtp.recursive_steps,
                 "hidden_cache": cfg.train.hidden_cache, "freeze_backbone": True,
                 "data": cfg.data.name}
  t0 = time.monotonic()
  result, by_budget = run_train(cfg, args.workdir, stamps, run, deadline,
                                args.stop_after_step or None)
  t["wall_s"] = round(t.get("wall_s", 0.0) + time.monotonic() - t0, 2)
  t["step"], t["step_time_s"] = result.step, result.step_time_s
  t["stopped_by_budget"] = by_budget
  user_signal = result.interrupted and not by_budget
  # a budget-stopped stage is evaluated and exported at its latest step, and a re-run
  # (another budget) trains on toward num_steps
  t["done"] = result.step >= n
  save()
  if user_signal:
    cli.exit_if_interrupted(result.as_dict(), n, "training", args.workdir)
  return t


# -- step 4: held-out agreement --------------------------------------------------------------

def heldout_alpha(workdir: str, per_category: int, temperatures, max_new_tokens: int) -> dict:
  """Held-out agreement of the stage's latest checkpoint (float32): per
  temperature, every category's first ``per_category`` held-out prompts
  decoded in one batch with G = the trained draft offsets (D + recursive
  steps); {"T<t>": {"overall": {tau, alpha}, "categories": {category:
  {rows, tau, alpha [G]}}}, "num_draft_tokens": G, "step": step}."""
  from decode.cli import stats
  from decode.decoder import Decoder, SamplingParams
  from mtp import loading
  from mtp import tokenizer as tok_lib
  from mtp.data import chat as chat_lib
  from scripts.bench_chat import heldout_prompts
  cfg, model, step = loading.load_model(workdir)
  cfg, model = loading.override_model(cfg, model, dtype="float32")
  tokenizer = tok_lib.load_tokenizer(workdir)
  g = cfg.mtp.depth + cfg.mtp.recursive_steps
  by_cat = heldout_prompts(chat_lib.HELDOUT_CHAT_PATH, tokenizer, per_category)
  prompts = [p for ps in by_cat.values() for p in ps]
  cats = [c for c, ps in by_cat.items() for _ in ps]
  decoder = Decoder(model, "mtp", g, tokenizer=tokenizer)
  out = {"num_draft_tokens": g, "step": int(step), "prompts": len(prompts)}
  for temp in temperatures:
    gen = decoder.generate(prompts, max_new_tokens, SamplingParams(temperature=temp), seed=0)
    s = stats.summarize(gen)
    per = stats.summarize_by_category(gen, cats)
    out[f"T{temp:g}"] = {
        "overall": {"tau": s["mean_accepted_length"], "alpha": s["acceptance_rate_per_position"],
                    "num_tokens": s["num_tokens"]},
        "categories": {c: {"rows": v["rows"], "tau": v["mean_accepted_length"],
                           "alpha": v["acceptance_rate_per_position"]} for c, v in per.items()}}
    a = s["acceptance_rate_per_position"]
    log(f"[heldout] T={temp:g}: tau {s['mean_accepted_length']:.3f}, alpha "
        + " ".join("-" if x is None else f"{x:.3f}" for x in a))
  return out


# -- the run ---------------------------------------------------------------------------------

def metrics_rows(workdir: str) -> list[dict]:
  """The stage's metrics.jsonl rows (unreadable lines skipped)."""
  from train.workdir import METRICS_FILE
  path = os.path.join(workdir, METRICS_FILE)
  rows = []
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      for line in f:
        try:
          rows.append(json.loads(line))
        except ValueError:
          continue
  return rows


def report_results(args, state: dict) -> dict:
  """The report's results from the state and the stage's metrics."""
  t = state.get("train", {})
  cfg = t.get("config", {})
  positions = cfg.get("depth", args.depth) + cfg.get("recursive_steps", 0)
  gen = state.get("generation", {})
  parts = gen.get("parts", [])
  done = all(state.get(k, {}).get("done") for k in ("generation", "train", "heldout", "modules"))
  return {"status": "complete" if done else "partial",
          "budget": state["runs"][-1]["budget"], "runs": state["runs"],
          "generation": {**gen, "prompts": sum(p["prompts"] for p in parts),
                         "answer_tokens": sum(p["answer_tokens"] for p in parts),
                         "batch_size": args.batch_size, "temperatures": args.gen_temperatures,
                         "max_new_tokens": args.max_new_tokens},
          "train": {k: v for k, v in t.items()},
          "curve": curve(metrics_rows(args.workdir), state.get("stamps", {}), positions),
          "heldout": state.get("heldout", {}).get("result"),
          "modules": state.get("modules")}


def run(args, argv) -> int:
  """Steps 1-5 of the module docstring under the lock of ``--workdir``
  (``train.workdir.WorkdirLock``, the one training takes: one run per
  workdir, so two runs never answer the same parts); returns the exit
  status. Raises WorkdirBusyError when another run holds the workdir."""
  from train.workdir import WorkdirLock
  os.makedirs(args.workdir, exist_ok=True)
  with contextlib.ExitStack() as stack:
    lock = WorkdirLock(args.workdir)
    lock.acquire(log=log)
    stack.callback(lock.release)
    return _run(args, argv)


def _run(args, argv) -> int:
  import datetime

  import jax

  from mtp import report
  resolve_auto(args, jax.default_backend())
  state = read_state(args.workdir) or {"recipe": recipe_of(args), "runs": []}
  if state["recipe"] != recipe_of(args):
    diff = [k for k in RECIPE_KEYS if state["recipe"].get(k) != recipe_of(args).get(k)]
    from mtp.config import ConfigError
    raise ConfigError(f"--workdir={args.workdir!r} holds a run with other arguments "
                      f"({', '.join(f'--{k}' for k in diff)} differ); re-run with its arguments "
                      f"(in {os.path.join(args.workdir, STATE_FILE)}) or give another --workdir")
  gen_s = args.budget_s * args.gen_share
  budget = {"budget_s": args.budget_s, "gen_share": args.gen_share,
            "generation_s": round(gen_s, 1), "eval_s": args.eval_s,
            "train_s": round(args.budget_s - gen_s - args.eval_s, 1)}
  this = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "budget": budget, "used_s": {}}
  state["runs"].append(this)
  run_index = len(state["runs"]) - 1
  save = lambda: write_state(args.workdir, state)
  meta = report.provenance(command=report.command_line(os.path.join(REPO, "scripts",
                                                                    "smollm_mtp_device.py"), argv),
                           argv=list(sys.argv[1:] if argv is None else argv),
                           backend=jax.default_backend(), quick=args.quick,
                           datetime_utc=this["started"])
  out_report = lambda: report.write_report(args.out, meta, report_results(args, state))
  all_done = all(state.get(k, {}).get("done") for k in ("generation", "train", "heldout", "modules"))
  if all_done:
    log(f"finished in an earlier run: re-reporting to {args.out}.json")
    this["used_s"]["total"] = round(elapsed(), 2)
    save()
    out_report()
    return 0
  log(f"budget {args.budget_s:g} s: generation {gen_s:.0f} s, training "
      f"{budget['train_s']:.0f} s, evaluation and export {args.eval_s:g} s "
      f"({jax.default_backend()}: answer batch {args.batch_size}, train batch "
      f"{args.train_batch}, {args.dtype})")
  t0 = elapsed()
  ensure_init_workdir(args.base_workdir, args.init_workdir, args.depth)
  names = generate(args, state, gen_s, save)
  this["used_s"]["generation"] = round(elapsed() - t0, 2)
  t0 = elapsed()
  train_deadline = args.budget_s - args.eval_s
  train_phase(args, state, names, train_deadline, run_index, save)
  this["used_s"]["train"] = round(elapsed() - t0, 2)
  save()
  out_report()
  t0 = elapsed()
  if not state.get("heldout", {}).get("done") or state["heldout"]["result"]["step"] != latest_step(args.workdir):
    state["heldout"] = {"done": state["train"]["done"], "result": heldout_alpha(
        args.workdir, args.heldout_per_category, args.temperatures, args.heldout_max_new_tokens)}
    save()
  this["used_s"]["heldout"] = round(elapsed() - t0, 2)
  t0 = elapsed()
  rc = export(args, state, argv)
  this["used_s"]["export"] = round(elapsed() - t0, 2)
  this["used_s"]["total"] = round(elapsed(), 2)
  save()
  out_report()
  log(f"wrote {args.out}.json and {args.modules_out} in {elapsed():.0f} s "
      f"(budget {args.budget_s:g} s)")
  return rc


def export(args, state: dict, argv) -> int:
  """The modules file of the stage's latest checkpoint (``mtp.export
  --modules_out``, bfloat16); returns 1 when it is 16 MB or more."""
  from mtp import report
  from mtp.exporting import export_modules
  step = latest_step(args.workdir)
  m = state.get("modules") or {}
  if m.get("step") == step and os.path.isfile(args.modules_out):
    return 0 if m["under_16mb"] else 1
  path = export_modules(args.workdir, args.modules_out, overwrite=True,
                        command=report.command_line(os.path.join(REPO, "scripts",
                                                                 "smollm_mtp_device.py"), argv))
  size = os.path.getsize(path)
  state["modules"] = {"path": args.modules_out, "bytes": size, "step": step,
                      "under_16mb": size < MODULES_LIMIT_BYTES,
                      "done": bool(state.get("train", {}).get("done"))}
  if size >= MODULES_LIMIT_BYTES:
    log(f"error: the modules file {path} has {size:,} bytes, not < 16 MB")
    return 1
  return 0


def main(argv=None) -> int:
  from mtp import cli
  args = parse_args(argv)
  # before any work: a bad output path fails now, not after the answers and the training
  for flag, kind in (("out", "prefix"), ("workdir", "dir"), ("modules_out", "file"),
                     ("data_dir", "dir"), ("init_workdir", "dir")):
    if flag != "init_workdir" or not os.path.isdir(os.path.join(args.init_workdir, "checkpoints")):
      cli.check_output_path(flag, getattr(args, flag), kind)   # a made init workdir is only read
  if args.quick:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from decode.decoder import DecodeError
  from mtp.export.modules import ModulesFileError
  from mtp.importers import ModelImportError
  from mtp.tokenizer_files import TokenizerError
  from train.workdir import WorkdirBusyError
  try:
    return run(args, argv)
  except cli.input_errors() + (DecodeError, ModelImportError, ModulesFileError, TokenizerError,
                               WorkdirBusyError) as e:
    print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  from mtp import cli
  cli.main_guard(main)
