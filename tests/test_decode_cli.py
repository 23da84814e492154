"""python -m decode: report format, prompt files, bad input naming the flag."""

import json
import os
import subprocess
import sys

import pytest

from decode.run import read_prompt_file, run
from decode.speculative import DecodeError, SamplingParams
from mtp.checkpoint import CheckpointError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATS_KEYS = {"mean_accepted_length", "acceptance_rate_per_position", "accepted_length_histogram",
              "target_calls", "ttft_s", "itl_p50_s", "itl_p90_s", "tokens_per_s"}


@pytest.fixture(scope="module")
def workdir(markov_workdir):
  return markov_workdir


def test_run_report_has_tokens_text_and_stats(workdir, capsys):
  report = run(workdir, ["abca", "fed"], method="mtp", num_draft_tokens=2, max_new_tokens=12,
               sampling=SamplingParams(temperature=1.0, top_p=0.9), num_samples=2, seed=1,
               compare=True)
  assert [(r["prompt"], r["sample"]) for r in report["results"]] == [
      ("abca", 0), ("abca", 1), ("fed", 0), ("fed", 1)]
  assert len(report["results"]) == 4
  for r in report["results"]:
    assert set(r) >= {"prompt", "sample", "tokens", "text", "stats"}
    assert STATS_KEYS <= set(r["stats"]) and 1 <= len(r["tokens"]) <= 12
  assert STATS_KEYS <= set(report["stats"]) and STATS_KEYS <= set(report["ar_stats"])
  assert report["speedup"] > 0
  s = report["stats"]
  assert sum(s["accepted_length_histogram"]) == s["target_calls"]
  assert len(s["acceptance_rate_per_position"]) == 2
  json.dumps(report)          # serialisable
  out = capsys.readouterr().out
  assert "tau" in out and "speedup over AR" in out
  assert "--- prompt 1 sample 1: 'fed'" in out


def test_stream_prints_the_continuation(workdir, capsys):
  report = run(workdir, ["abc"], method="ar", max_new_tokens=5,
               sampling=SamplingParams(temperature=0.0))
  out = capsys.readouterr().out
  assert out.startswith("abc" + report["results"][0]["text"])


def test_prompt_file_errors(tmp_path):
  bad = tmp_path / "bad.txt"
  bad.write_bytes(b"fine\n\xff\xfe broken\n")
  with pytest.raises(DecodeError, match="line 2 is not valid UTF-8"):
    read_prompt_file(str(bad))
  empty = tmp_path / "empty.txt"
  empty.write_text("\n  \n")
  with pytest.raises(DecodeError, match="no non-empty prompt"):
    read_prompt_file(str(empty))
  with pytest.raises(DecodeError, match="prompt_file"):
    read_prompt_file(str(tmp_path / "missing.txt"))
  ok = tmp_path / "ok.txt"
  ok.write_text("def f(x):\\n  return\nimport os\n")
  assert read_prompt_file(str(ok)) == ["def f(x):\\n  return", "import os"]   # taken literally


def test_run_errors(workdir, tmp_path):
  with pytest.raises(CheckpointError, match="no checkpoint"):
    run(str(tmp_path), ["x"])
  with pytest.raises(DecodeError, match="empty"):
    run(workdir, [""], method="ar")
  with pytest.raises(DecodeError, match="draft_workdir"):
    run(workdir, ["x"], method="draft")
  with pytest.raises(DecodeError, match="num_samples"):
    run(workdir, ["x"], method="ar", num_samples=0)


def _cli(*args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "decode", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


def test_cli_end_to_end_and_errors(workdir, tmp_path):
  out = tmp_path / "r.json"
  r = _cli("--workdir", workdir, "--prompt", "abc", "--max_new_tokens", "6", "--method", "mtp",
           "--temperature", "0", "--json", str(out))
  assert r.returncode == 0, r.stderr[-2000:]
  assert STATS_KEYS <= set(json.loads(out.read_text())["stats"])
  r = _cli("--workdir", workdir, "--prompt", "abc", "--temperature", "-1")
  assert r.returncode == 2 and "--temperature" in r.stderr
  r = _cli("--workdir", str(tmp_path / "nowhere"), "--prompt", "abc")
  assert r.returncode == 2 and "no checkpoint" in r.stderr
