"""scripts.eval_alpha: counts per (category, T, G) and the ratios printed
from them (alpha_1 = first-draft accepts / rounds, tau = tokens / calls)
rebuild from the JSON rows; flag errors are one line before jax loads."""

import subprocess
import sys
import types

import numpy as np

from scripts import eval_alpha


def test_counts_and_ratios_rebuild():
  gen = types.SimpleNamespace(
      accepted_histogram=np.array([[3, 5], [4, 0], [1, 1]]),
      tokens=[np.zeros(13), np.zeros(4), np.zeros(3)], target_calls=np.array([8, 4, 2]))
  c = eval_alpha.count_rows(gen, [0, 2])
  assert c == {"rounds": 10, "first_accepted": 6, "tokens": 16, "target_calls": 10}
  rows = eval_alpha.summary({("code", 0.0, 1): c, ("math", 0.0, 1): eval_alpha.count_rows(gen, [1])})
  for r in rows:
    assert r["alpha_1"] == r["first_accepted"] / r["rounds"] and r["tau"] == r["tokens"] / r["target_calls"]
  pooled = eval_alpha.pooled(rows, lambda r: r["G"])[1]
  assert pooled["alpha_1"] == 6 / 14 and pooled["tau"] == 20 / 14


def test_prompts_per_category_and_extra_chats(tmp_path):
  f = tmp_path / "p.jsonl"
  f.write_text("".join(f'{{"category": "{c}", "prompt": "q{i}"}}\n' for i, c in enumerate("aabab")))
  got = eval_alpha.load_prompts([str(f)], 2, ["Write a haiku about autumn leaves."])
  assert [p["prompt"] for p in got] == ["q0", "q1", "q2", "q4", "Write a haiku about autumn leaves."]
  assert got[-1]["category"] == "chat:Write a haiku about"


def test_a_bad_flag_is_one_line_before_jax():
  code = ("import sys, runpy; sys.argv = ['eval_alpha', '--workdir', 'x', '--temperatures', '-1'];"
          "\ntry: runpy.run_module('scripts.eval_alpha', run_name='__main__')\n"
          "except SystemExit as e: print('jax' in sys.modules, e.code)")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert r.stdout.split() == ["False", "2"], r
  assert len(r.stderr.strip().splitlines()) == 1 and "--temperatures" in r.stderr
