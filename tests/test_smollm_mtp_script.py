"""scripts/smollm_mtp.py (``make smollm-mtp``) runs the commands the Makefile
recipe ran: names of workdirs, datasets and assets per variant, skipped
imports, a failing step ending the run. Nothing here runs JAX."""

import importlib
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "smollm_mtp.py")
PY = "PY"
GGUF = '"$(PY -m mtp.importers.smollm)"'


def dry_run(*flags):
  # the CPU's answer batch (32) on any backend: make test-gpu runs this too
  r = subprocess.run([sys.executable, SCRIPT, "--dry_run", *flags], cwd=REPO,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"},
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, r.stderr
  return r.stdout.replace(sys.executable, PY).splitlines()


def expected(depth=1, suffix="", modules="assets/smollm2_mtp1.safetensors", seeds=(), train_extra=""):
  """The old Makefile recipe's commands (make -n smollm-mtp, for loop unrolled)."""
  distill = f"{PY} -m scripts.self_distill --workdir runs/smollm"
  answer = "--temperatures 0,1 --method ar --batch_size 32 --max_new_tokens 160"
  name = "+".join(["smollm_chat"] + [f"smollm_chat_s{s}" for s in seeds])
  stage = f"runs/smollm_mtp{suffix}"
  return [
      f"test -d runs/smollm/checkpoints || {PY} -m mtp.importers --gguf {GGUF} --workdir runs/smollm",
      f"test -d runs/smollm_d{depth}/checkpoints || {PY} -m mtp.importers --gguf {GGUF} "
      f"--workdir runs/smollm_d{depth} --mtp_depth {depth} --mtp_init random --seed 0",
      f"{distill} --out_name smollm_chat --out_dir runs/data --chat_prompts 1100 --val_prompts 44 {answer}",
  ] + [
      f"{distill} --out_name smollm_chat_s{s} --out_dir runs/data --chat_prompts 1100 --val_prompts 0 "
      f"{answer} --seed {s}" for s in seeds
  ] + [
      f"{PY} -m train --config configs/smollm_mtp.py:runs/smollm_d{depth} --workdir {stage} "
      f"--config.data.data_dir=runs/data --config.data.name={name} "
      f"--config.train.hidden_cache_dir=runs/hidden_caches{train_extra}",
      f"{PY} -m mtp.export --workdir {stage} --modules_out {modules} --overwrite",
      f"{PY} scripts/bench_chat.py --workdir {stage} --out results/bench_chat_smollm{suffix}",
  ]


@pytest.mark.parametrize("flags,want", [
    ([], expected()),
    (["--depth", "2"], expected(2, "_d2", "assets/smollm2_mtp2.safetensors")),
    (["--features", "2,15"], expected(1, "_fl", "assets/smollm2_mtp1_fl.safetensors",
                                      train_extra=" --config.mtp.feature_layers=2,15")),
    (["--data_seeds", "0 1 2"], expected(1, "_x3", "assets/smollm2_mtp1_x3.safetensors", (1, 2))),
    (["--steps", "1200"], expected(1, "_s1200", "assets/smollm2_mtp1_s1200.safetensors",
                                   train_extra=" --config.train.num_steps=1200")),
    # make's $(sort): unique, lexical order; empty flags as the Makefile passes them
    (["--depth", "3", "--features", "", "--data_seeds", "2 0 10 2", "--steps", "50"],
     expected(3, "_d3_x3_s50", "assets/smollm2_mtp3_x3_s50.safetensors", (10, 2),
              " --config.train.num_steps=50")),
])
def test_dry_run_prints_the_makefile_commands(flags, want):
  assert dry_run(*flags) == want


def test_answer_batch_follows_the_backend_or_the_flag(monkeypatch, tmp_path):
  script = importlib.import_module("scripts.smollm_mtp")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  none = str(tmp_path / "no_data")
  assert script.answer_batch("auto", none) == 32  # the committed data's recipe: resumes as is
  monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
  assert script.answer_batch("auto", none) == 256
  assert script.answer_batch("7") == 7
  # an existing dataset's recorded batch wins over the backend's (its recipe must match)
  meta = tmp_path / "smollm_chat" / "1.0.0" / "metadata.json"
  meta.parent.mkdir(parents=True)
  meta.write_text('{"recipe": {"batch_size": 48}}')
  assert script.answer_batch("auto", str(tmp_path)) == 48
  partial = tmp_path / "p" / ".smollm_chat.partial" / "recipe.json"
  partial.parent.mkdir(parents=True)
  partial.write_text('{"workdir": "w", "recipe": {"batch_size": 24}}')
  assert script.answer_batch("auto", str(tmp_path / "p")) == 24
  assert "--batch_size 8 " in " ".join(dry_run("--answer_batch_size", "8")[2:3])


def test_bad_flags_fail_naming_the_flag():
  for flags, needle in [(["--answer_batch_size", "0"], "--answer_batch_size"), (["--depth", "0"], "--depth"), (["--steps", "x"], "--steps"),
                        (["--data_seeds", "1,-2"], "--data_seeds"), (["--features", "a"], "--features")]:
    r = subprocess.run([sys.executable, SCRIPT, "--dry_run", *flags], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and needle in r.stderr.splitlines()[-1], (flags, r.stderr)


def test_imports_skip_when_done_and_a_failing_step_ends_the_run(tmp_path, monkeypatch):
  script = importlib.import_module("scripts.smollm_mtp")
  base, init = tmp_path / "smollm", tmp_path / "smollm_d1"
  for d in (base, init):
    (d / "checkpoints").mkdir(parents=True)
  ran = []

  def fake_run(argv, cwd=None, **kw):
    ran.append(argv)
    return subprocess.CompletedProcess(argv, 3 if "mtp.export" in argv else 0)

  monkeypatch.setattr(script.subprocess, "run", fake_run)
  monkeypatch.setattr(script, "gguf_path", lambda: pytest.fail("no import should run"))
  rc = script.main(["--base_workdir", str(base), "--init_workdir", str(init), "--data_seeds", "0,1"])
  assert rc == 3
  assert [a[2] for a in ran] == ["scripts.self_distill", "scripts.self_distill", "train", "mtp.export"]
  assert all(a[0] == sys.executable for a in ran)
