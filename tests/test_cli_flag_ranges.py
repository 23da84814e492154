"""Issue 51.3: every CLI the README and docs show refuses a flag value out
of its range (and decode a pair of flags that exclude each other) in one stderr line naming the flag, exit status 2, before jax,
flax or tensorflow is imported (the docs say flags are checked before
anything loads; importing jax alone takes seconds and ~250 MB)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("jax", "flax", "tensorflow")

# Runs a module or script as __main__ and writes, at exit, which of HEAVY it imported.
_WRAPPER = """
import atexit, os, runpy, sys
sys.path.insert(0, os.getcwd())
def _mark():
  with open(os.environ["HEAVY_OUT"], "w") as f:
    f.write(" ".join(m for m in {heavy!r} if m in sys.modules))
atexit.register(_mark)
target, sys.argv = sys.argv[1], sys.argv[1:]
if target.endswith(".py"):
  runpy.run_path(target, run_name="__main__")
else:
  runpy.run_module(target, run_name="__main__", alter_sys=True)
""".format(heavy=HEAVY)

NOWHERE = "runs/no_such_workdir_for_flag_tests"
CASES = [
    ("decode", ["--prompt", "a", "--top_p", "2"], "--top_p"),
    ("decode", ["--prompt", "a", "--num_draft_tokens", "99"], "--num_draft_tokens"),
    ("decode", ["--prompt", "a", "--max_new_tokens", "0"], "--max_new_tokens"),
    ("decode", ["--prompt", "a", "--temperature", "-1"], "--temperature"),
    ("decode", ["--prompt", "a", "--max_draft_tokens", "17"], "--max_draft_tokens"),
    ("decode", ["--prompt", "a", "--dtype", "float16"], "--dtype"),
    ("decode", ["--prompt", "a", "--max_new_tokens", "abc"], "--max_new_tokens"),
    # rules between two flags, checked before jax too
    ("decode", ["--prompt", "a", "--chat", "b"], "--prompt"),
    ("decode", ["--prompt", "a", "--tree", "2,1", "--num_draft_tokens", "2"], "--tree"),
    ("decode", ["--prompt", "a", "--method", "draft", "--num_draft_tokens", "auto"],
     "--num_draft_tokens"),
    ("decode", ["--prompt", "a", "--method", "ar", "--tree", "2,1"], "--tree"),
    ("decode", ["--prompt", "a", "--json", "runs/no_such_folder_for_flag_tests/r.json"], "--json"),
    ("decode", ["--prompt", ""], "--prompt"),
    ("decode", ["--prompt", "a", "--tree", "0,1"], "--tree"),
    ("decode", ["--prompt", "a", "--method", "draft"], "--draft_workdir"),
    ("decode", ["--prompt", "a", "--stop", ""], "--stop"),
    ("scripts/self_distill.py", ["--workdir", NOWHERE, "--out_name", "x", "--chat_prompts", "4",
                                 "--snapshot", "x"], "--snapshot"),
    ("scripts/self_distill.py", ["--workdir", NOWHERE, "--out_name", "x", "--chat_prompts", "4",
                                 "--snapshot", "Bad-Name"], "--snapshot"),
    ("scripts/self_distill.py", ["--workdir", NOWHERE, "--out_name", "x", "--snapshot", "y"],
     "--snapshot"),
    ("train", ["--config", "configs/tiny.py", "--config.train.num_steps=-1"], "train.num_steps"),
    ("train", ["--config", "configs/tiny.py", "--num_processes", "0"], "--num_processes"),
    ("mtp.export", ["--out", "exports/never", "--step", "-1"], "--step"),
    ("mtp.importers", ["--gguf", "x.gguf", "--mtp_depth", "-1"], "--mtp_depth"),
    ("mtp.importers", ["--gguf", "x.gguf", "--mtp_init_scale", "nan"], "--mtp_init_scale"),
    ("scripts/smollm_mtp.py", ["--steps", "-5"], "--steps"),
    ("scripts/bench_decode.py", ["--workdir", NOWHERE, "--repeats", "0"], "--repeats"),
    ("scripts/bench_decode.py", ["--workdir", NOWHERE, "--num_draft_tokens", "17"],
     "--num_draft_tokens"),
    ("scripts/bench_baselines.py", ["--workdir", NOWHERE, "--repeats", "0"], "--repeats"),
    ("scripts/bench_baselines.py", ["--workdir", NOWHERE, "--num_draft_tokens", "99"],
     "--num_draft_tokens"),
    ("scripts/self_prompts.py", ["--workdir", NOWHERE, "--out", "x.jsonl", "--top_p", "0"],
     "--top_p"),
    ("scripts/self_prompts.py", ["--workdir", NOWHERE, "--out", "x.jsonl", "--batch_size", "0"],
     "--batch_size"),
    ("scripts/self_distill.py", ["--workdir", NOWHERE, "--out_name", "x", "--num_docs", "0"],
     "--num_docs"),
    ("scripts/self_distill.py", ["--workdir", NOWHERE, "--out_name", "x", "--top_p=1.5"],
     "--top_p"),
    ("experiments/ablate_mtp.py", ["--depths", "0,17"], "--depths"),
    ("experiments/ablate_mtp.py", ["--num_steps", "0"], "--num_steps"),
    ("experiments/sweep_decode.py", ["--workdir", NOWHERE, "--top_ps", "0"], "--top_ps"),
    ("experiments/sweep_decode.py", ["--workdir", NOWHERE, "--num_draft_tokens", "17"],
     "--num_draft_tokens"),
    ("experiments/distill_mtp.py", ["--workdir", NOWHERE, "--distill_weight", "0"],
     "--distill_weight"),
    ("experiments/compare_drafters.py", ["--workdir", NOWHERE, "--num_draft_tokens", "0"],
     "--num_draft_tokens"),
    ("experiments/bench_draft_cost.py", ["--layers", "0"], "--layers"),
    ("experiments/sweep_draft_vocab.py", ["--workdir", NOWHERE, "--iters", "0"], "--iters"),
    ("experiments/simulate_speedup.py", ["--g_max", "0"], "--g_max"),
    ("experiments/replay_schedule.py", ["--workdir", NOWHERE, "--top_p", "0"], "--top_p"),
    ("experiments/losslessness_study.py", ["--workdir", NOWHERE, "--num_tokens", "65"],
     "--num_tokens"),
    ("experiments/bench_round.py", ["--workdir", NOWHERE, "--repeats", "0"], "--repeats"),
]


@pytest.mark.parametrize("target,args,flag", CASES, ids=[f"{c[0]} {c[2]}" for c in CASES])
def test_a_bad_flag_is_one_line_before_jax(target, args, flag, tmp_path):
  out = tmp_path / "heavy.txt"
  workdir = [] if target.endswith(".py") else ["--workdir", NOWHERE]
  r = subprocess.run([sys.executable, "-c", _WRAPPER, target, *workdir, *args], cwd=REPO,
                     capture_output=True, text=True, timeout=120,
                     env={**os.environ, "HEAVY_OUT": str(out), "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 2, r.stderr[-1000:]
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and flag in lines[0], r.stderr[-1000:]
  assert out.read_text() == "", f"{target} imported {out.read_text()} before refusing {flag}"
  assert not os.path.exists(os.path.join(REPO, NOWHERE))


def test_export_creates_the_missing_parents_of_out_and_removes_them_on_failure(tmp_path):
  """--out under missing folders: they are made (README's exports/tiny), and
  removed again when the export fails (here: no checkpoint)."""
  sys.path.insert(0, REPO)
  from mtp.export.__main__ import make_parents
  made = make_parents(str(tmp_path / "a" / "b" / "out"))
  assert made == [str(tmp_path / "a"), str(tmp_path / "a" / "b")] and (tmp_path / "a" / "b").is_dir()
  assert make_parents(str(tmp_path / "a" / "b" / "out")) == []
  out = tmp_path / "x" / "y" / "tiny"
  r = subprocess.run([sys.executable, "-m", "mtp.export", "--workdir", str(tmp_path / "none"),
                      "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 2 and "no checkpoint" in r.stderr and "parent" not in r.stderr, r.stderr
  assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("module", ["mtp.export"])   # decode, train: tests/test_cli_small_things.py
def test_help_exits_zero_before_jax(module, tmp_path):
  out = tmp_path / "heavy.txt"
  r = subprocess.run([sys.executable, "-c", _WRAPPER, module, "--help"], cwd=REPO,
                     capture_output=True, text=True, timeout=120,
                     env={**os.environ, "HEAVY_OUT": str(out), "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0 and "--workdir" in r.stdout, r.stderr[-1000:]
  assert out.read_text() == "", f"{module} --help imported {out.read_text()}"
