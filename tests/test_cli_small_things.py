"""What a user meets first: a line when an answer stops at its token budget
(once per run, counting rows in a batch; none when rows end at EOS or a
stop), --help exiting 0 on python -m decode and python -m train, and
--method mtp drafting with "auto" unless --num_draft_tokens is given."""

import io
import json
import os
import subprocess
import sys

import pytest

from decode.cli.results import length_notice
from decode.cli.run import DecodeRequest, run
from decode.decoder import SamplingParams
from decode.stops import StopConditions

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def workdir(markov_workdir):
  return markov_workdir


def _cli(module, *args, timeout=300):
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True,
                        text=True, timeout=timeout, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_length_notice_text():
  assert length_notice(["length"], 128) == (
      'the answer stopped at --max_new_tokens=128 (finish reason "length"): raise it for a '
      "longer answer\n")
  assert length_notice(["eos", "length", "stop", "length"], 64) == (
      '2 of 4 rows stopped at --max_new_tokens=64 (finish reason "length"): raise it for '
      "longer answers\n")
  for reasons in (["eos"], ["stop", "eos"], ["interrupted"], [], None):
    assert length_notice(reasons, 128) is None


def test_the_budget_line_appears_once_when_rows_hit_max_new_tokens(workdir):
  kw = dict(method="ar", sampling=SamplingParams(temperature=0.0))
  out = io.StringIO()
  err = io.StringIO()
  report = run(DecodeRequest(workdir, ["abca"], max_new_tokens=6, **kw), out=out, err=err).to_json()
  assert report["results"][0]["finish_reason"] == "length"
  assert err.getvalue().count("stopped at --max_new_tokens=6") == 1
  assert "the answer stopped at --max_new_tokens=6" in err.getvalue()
  # the row ends on a token it emits (a stop id, kept like EOS): no line
  first = report["results"][0]["tokens"][0]
  err = io.StringIO()
  report = run(DecodeRequest(workdir, ["abca"], max_new_tokens=6,
                             stops=StopConditions(token_ids=(first,)), **kw),
               out=out, err=err).to_json()
  assert report["results"][0]["finish_reason"] != "length"
  assert "stopped at --max_new_tokens" not in err.getvalue()
  # a batch: one line counting the rows that hit the budget
  err = io.StringIO()
  report = run(DecodeRequest(workdir, ["abca", "fed"], max_new_tokens=6, num_samples=2, **kw),
               out=out, err=err).to_json()
  cut = sum(r["finish_reason"] == "length" for r in report["results"])
  assert cut >= 1 and err.getvalue().count("stopped at --max_new_tokens") == 1
  assert f"{cut} of 4 rows stopped at --max_new_tokens=6" in err.getvalue()


@pytest.mark.parametrize("module", ["decode", "train"])
def test_help_exits_zero(module):
  r = _cli(module, "--help", timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "--workdir" in r.stdout and f"python -m {module}" in r.stdout
  assert _cli(module, "--no_such_flag", timeout=120).returncode == 2    # bad input stays 2


@pytest.mark.cpu_only
def test_method_mtp_defaults_to_auto(workdir, tmp_path):
  out = tmp_path / "r.json"
  # one token: auto sees that drafting cannot pay and decodes AR without calibrating (fast)
  r = _cli("decode", "--workdir", workdir, "--prompt", "abca", "--method", "mtp",
           "--max_new_tokens", "1", "--temperature", "0", "--json", str(out))
  assert r.returncode == 0, r.stderr[-2000:]
  config = json.loads(out.read_text())["config"]
  assert config["num_draft_tokens"] == "auto" and config["max_draft_tokens"] == 2   # D = 2
  assert "chosen draft length histogram" in r.stderr and "note:" not in r.stderr
  assert "the answer stopped at --max_new_tokens=1" in r.stderr
