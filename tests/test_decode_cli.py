"""python -m decode: report format, prompt files, bad input naming the flag."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from decode.cli.run import (DecodeRequest, flag_notices, parse_num_draft_tokens, read_prompt_file,
                            run)
from decode.decoder import DecodeError, SamplingParams
from mtp.checkpoint import CheckpointError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATS_KEYS = {"mean_accepted_length", "acceptance_rate_per_position", "accepted_length_histogram",
              "target_calls", "ttft_s", "itl_p50_s", "itl_p90_s", "tokens_per_s"}


@pytest.fixture(scope="module")
def workdir(markov_workdir):
  return markov_workdir


def test_run_report_has_tokens_text_and_stats(workdir, capsys):
  report = run(DecodeRequest(workdir, ["abca", "fed"], method="mtp", num_draft_tokens=2,
                             max_new_tokens=12, sampling=SamplingParams(temperature=1.0, top_p=0.9),
                             num_samples=2, seed=1, compare=True, repeats=2)).to_json()
  assert [(r["prompt_index"], r["prompt"], r["sample"]) for r in report["results"]] == [
      (0, "abca", 0), (0, "abca", 1), (1, "fed", 0), (1, "fed", 1)]
  for r in report["results"]:
    assert set(r) >= {"prompt", "sample", "tokens", "text", "stats"}
    assert STATS_KEYS <= set(r["stats"]) and 1 <= len(r["tokens"]) <= 12
  assert STATS_KEYS <= set(report["stats"]) and STATS_KEYS <= set(report["ar_stats"])
  assert report["repeats"] == 2 and len(report["speedup_per_repeat"]) == 2
  times = report["wall_times_s"]
  assert set(times) == {"ar", "mtp"} and len(times["ar"]) == len(times["mtp"]) == 2
  assert report["speedup"] == pytest.approx(float(np.median(times["ar"]) / np.median(times["mtp"])))
  s = report["stats"]
  assert sum(s["accepted_length_histogram"]) == s["target_calls"]
  assert len(s["acceptance_rate_per_position"]) == 2
  json.dumps(report)          # serialisable
  steps = [int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()]
  assert report["config"]["checkpoint_step"] == max(steps)      # the step decoded is recorded
  out, err = capsys.readouterr()
  # stdout: the texts only; stderr: statistics and the comparison
  assert out == "".join(f"--- prompt {r['prompt_index']} sample {r['sample']}: {r['prompt']!r}\n"
                        f"{r['prompt']}{r['text']}\n" for r in report["results"])
  assert "tau" in err and "speedup over AR" in err and "2 interleaved repeats" in err
  assert "T > 0: mtp and AR sample different texts, mtp " in err   # rates over different texts
  assert "tau" not in out and "note:" not in err    # G = D: nothing to note


def test_auto_draft_length_report(workdir, capsys):
  """--num_draft_tokens auto: the report records "auto" and G_max, the
  summary the histogram of chosen draft lengths (one entry per round)."""
  report = run(DecodeRequest(workdir, ["abca", "fed"], method="mtp", num_draft_tokens="auto",
                             max_draft_tokens=3, max_new_tokens=16,
                             sampling=SamplingParams(temperature=0.0))).to_json()
  cfg, s = report["config"], report["stats"]
  assert cfg["num_draft_tokens"] == "auto" and cfg["max_draft_tokens"] == 3
  assert len(s["draft_length_histogram"]) == 4 and sum(s["draft_length_histogram"]) == s["target_calls"]
  assert len(s["acceptance_rate_per_position"]) == 3
  auto = cfg["auto"]                   # what the choices were made from
  assert len(auto["prior"]) >= 1 and all(0 < a < 1 for a in auto["prior"])
  (costs,) = auto["round_costs_s"].values()
  assert len(costs) == 4 and all(c > 0 for c in costs) and costs == sorted(costs)
  err = capsys.readouterr().err
  assert "chosen draft length histogram" in err
  assert "--max_draft_tokens=3 > the checkpoint's MTP depth D=2" in err
  assert parse_num_draft_tokens("auto") == "auto" and parse_num_draft_tokens("3") == 3
  assert parse_num_draft_tokens("16") == 16
  for bad in ("0", "x", "-2", "1.5", "17", "5000"):     # 1,100 once ran until the OOM killer
    with pytest.raises(DecodeError, match=r"num_draft_tokens.*integer in \[1, 16\] or 'auto'"):
      parse_num_draft_tokens(bad)
  with pytest.raises(DecodeError, match="auto needs --method=mtp"):
    run(DecodeRequest(workdir, ["abc"], method="draft", draft_workdir=workdir,
                      num_draft_tokens="auto"))
  with pytest.raises(DecodeError, match=r"num_draft_tokens=17 must be an integer in \[1, 16\]"):
    run(DecodeRequest(workdir, ["abc"], method="mtp", num_draft_tokens=17))  # the Decoder checks it too
  assert flag_notices(method="mtp", given={"max_draft_tokens"}, temperature=1.0, compare=False) == [
      "--max_draft_tokens has no effect without --num_draft_tokens=auto"]


def test_stream_prints_the_continuation(workdir, capsys):
  report = run(DecodeRequest(workdir, ["abc"], method="ar", num_draft_tokens=5, max_new_tokens=5,
                             sampling=SamplingParams(temperature=0.0))).to_json()
  out, err = capsys.readouterr()
  assert out == "abc" + report["results"][0]["text"] + "\n"
  assert "[ar] tokens" in err
  assert report["config"]["num_draft_tokens"] == 0     # nothing is drafted with AR


def test_flags_without_effect_get_one_notice_each():
  assert flag_notices(method="mtp", given={"num_draft_tokens", "top_p"}, temperature=0.7,
                      compare=True) == []
  notes = flag_notices(method="ar", given={"num_draft_tokens", "draft_workdir", "repeats"},
                       temperature=1.0, compare=True)
  assert len(notes) == 4
  for flag in ("--compare", "--num_draft_tokens", "--draft_workdir", "--repeats"):
    assert sum(n.startswith(flag) for n in notes) == 1, (flag, notes)
  assert "records num_draft_tokens 0" in next(n for n in notes if n.startswith("--num_draft"))
  greedy = flag_notices(method="mtp", given={"top_k", "seed"}, temperature=0.0, compare=False)
  assert greedy == ["--top_k, --seed have no effect at --temperature=0 (greedy: every token is "
                    "the argmax)"]


def test_prompt_file_lines_are_prompts(tmp_path):
  bad = tmp_path / "bad.txt"
  bad.write_bytes(b"fine\n\xff\xfe broken\n")
  with pytest.raises(DecodeError, match="line 2 is not valid UTF-8"):
    read_prompt_file(str(bad))
  blank = tmp_path / "blank.txt"
  blank.write_text("first\n\nthird\n")
  with pytest.raises(DecodeError, match="line 2 is empty"):   # would shift prompt indices
    read_prompt_file(str(blank))
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  with pytest.raises(DecodeError, match="is empty"):
    read_prompt_file(str(empty))
  with pytest.raises(DecodeError, match="prompt_file"):
    read_prompt_file(str(tmp_path / "missing.txt"))
  ok = tmp_path / "ok.txt"
  ok.write_bytes(b"def f(x):\\n  return\r\n  \nimport os")
  # taken literally: no escapes, a whitespace line is a prompt, CRLF and a missing final newline
  assert read_prompt_file(str(ok)) == ["def f(x):\\n  return", "  ", "import os"]


def test_run_errors(workdir, tmp_path):
  with pytest.raises(CheckpointError, match="no checkpoint"):
    run(DecodeRequest(str(tmp_path), ["x"]))
  with pytest.raises(DecodeError, match="empty"):
    run(DecodeRequest(workdir, [""], method="ar"))
  with pytest.raises(DecodeError, match="draft_workdir"):
    run(DecodeRequest(workdir, ["x"], method="draft"))
  with pytest.raises(DecodeError, match="num_samples"):
    run(DecodeRequest(workdir, ["x"], method="ar", num_samples=0))


def _cli(*args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "decode", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.cpu_only
def test_cli_end_to_end_and_errors(workdir, tmp_path):
  out = tmp_path / "r.json"
  r = _cli("--workdir", workdir, "--prompt", "abc", "--max_new_tokens", "6", "--method", "mtp",
           "--temperature", "0", "--top_k", "3", "--num_draft_tokens", "3", "--json", str(out))
  assert r.returncode == 0, r.stderr[-2000:]
  report = json.loads(out.read_text())
  assert STATS_KEYS <= set(report["stats"])
  meta = report["meta"]                       # provenance: commit, date, machine, command
  assert {"commit", "date", "cpu_model"} <= set(meta)
  assert meta["command"].startswith("python -m decode --workdir ") and "--json" in meta["command"]
  assert r.stdout == "abc" + report["results"][0]["text"] + "\n"     # `> out.txt` gets the text only
  notes = [l for l in r.stderr.splitlines() if l.startswith("note: ")]
  assert len(notes) == 2 and "--top_k has no effect" in notes[0] and "reuses module 2" in notes[1]
  assert "[mtp] tokens" in r.stderr
  r = _cli("--workdir", workdir, "--prompt", "abc", "--temperature", "-1")
  assert r.returncode == 2 and "--temperature" in r.stderr
  r = _cli("--workdir", str(tmp_path / "nowhere"), "--prompt", "abc")
  assert r.returncode == 2 and "no checkpoint" in r.stderr


def test_notice_counts_offsets_trained_by_recursive_steps(workdir, capsys, monkeypatch):
  """A checkpoint trained with mtp.recursive_steps=R has modules trained for
  D + R offsets: no "never trained" notice up to G = D + R, one past it."""
  import dataclasses
  from decode.cli import run as run_mod
  real = run_mod.loading.load_model

  def load_with_recursive_steps(path):
    cfg, model, step = real(path)
    return dataclasses.replace(cfg, mtp=dataclasses.replace(cfg.mtp, recursive_steps=1)), model, step

  monkeypatch.setattr(run_mod.loading, "load_model", load_with_recursive_steps)
  kw = dict(method="mtp", max_new_tokens=4, sampling=SamplingParams(temperature=0.0))
  run(DecodeRequest(workdir, ["abca"], num_draft_tokens=3, **kw))
  assert "note:" not in capsys.readouterr().err
  run(DecodeRequest(workdir, ["abca"], num_draft_tokens=4, **kw))
  err = capsys.readouterr().err
  assert ("--num_draft_tokens=4 > the 3 offsets the checkpoint's modules were trained for "
          "(D=2, mtp.recursive_steps=1): draft 4 reuses module 2") in err


def _cli_bytes(*args, env_extra=None):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env_extra or {})}
  return subprocess.run([sys.executable, "-m", "decode", *args], cwd=REPO, env=env,
                        capture_output=True, timeout=300)


@pytest.mark.cpu_only
def test_inputs_past_their_types_are_one_line_before_loading(tmp_path):
  """Issue 23.4: out-of-range numbers, non-UTF-8 prompt bytes and unknown
  flags exit 2 with one error line and no traceback, before any checkpoint
  is read (the workdir does not even exist)."""
  nowhere = str(tmp_path / "nowhere")
  cases = [
      (["--top_k", "2147483648"], b"--top_k=2147483648 must be an integer in [0, 2147483647]"),
      (["--top_k", "99999999999"], b"--top_k=99999999999"),
      (["--max_new_tokens", "0"], b"--max_new_tokens=0 must be an integer in [1,"),
      (["--seed", "-1"], b"--seed=-1 must be an integer in [0, 4294967295]"),
      (["--num_samples", "100000000"], b"--num_samples"),
      (["--stop_token_ids", "x"], b"--stop_token_ids: 'x' is not an integer"),
      (["--no_such_flag", "1"], b"no_such_flag"),
      (["main("], b"unexpected arguments 'main('"),           # an unquoted prompt's tail
      (["--num_draft_tokens", "5000"], b"--num_draft_tokens='5000' must be an integer in [1, 16]"),
      (["--json", str(tmp_path)], b"is a directory"),
  ]
  for extra, want in cases:
    r = _cli_bytes("--workdir", nowhere, "--prompt", "abc", *extra)
    assert r.returncode == 2, (extra, r.stderr[-500:])
    assert want in r.stderr and b"Traceback" not in r.stderr, (extra, r.stderr[-500:])
    assert b"no checkpoint" not in r.stderr, extra          # refused before loading
  # a byte that is not UTF-8 in --prompt (bytes argv), with a strict stdout
  r = _cli_bytes("--workdir", nowhere, b"--prompt=def \xff(",
                 env_extra={"PYTHONIOENCODING": "utf-8:strict"})
  assert r.returncode == 2 and b"Traceback" not in r.stderr, r.stderr[-500:]
  assert b"is not valid UTF-8: byte 0xFF at character 4" in r.stderr


@pytest.mark.cpu_only
def test_stop_string_through_the_cli(workdir, tmp_path):
  """--stop cuts the printed text before the stop string and the report
  records finish_reason "stop" (AR and MTP alike at T = 0)."""
  base = _cli("--workdir", workdir, "--prompt", "abc", "--max_new_tokens", "12",
              "--temperature", "0", "--method", "ar", "--json", str(tmp_path / "a.json"))
  assert base.returncode == 0, base.stderr[-2000:]
  text = json.loads((tmp_path / "a.json").read_text())["results"][0]["text"]
  stop = text[3:5]
  for method in ("ar", "mtp"):
    out = tmp_path / f"{method}.json"
    r = _cli("--workdir", workdir, "--prompt", "abc", "--max_new_tokens", "12", "--temperature",
             "0", "--method", method, "--stop", stop, "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())["results"][0]
    assert res["text"] == text[:text.find(stop)] and res["finish_reason"] == "stop"
    assert r.stdout == "abc" + res["text"] + "\n"
    assert "seed 0" in r.stderr


def test_a_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path):
  from mtp.data import chat
  bom = tmp_path / "bom.txt"
  bom.write_bytes(b"\xef\xbb\xbfabc\ndef\n")
  assert read_prompt_file(str(bom)) == ["abc", "def"]
  jsonl = tmp_path / "bom.jsonl"
  jsonl.write_bytes(b'\xef\xbb\xbf{"prompt": "hi", "category": "qa"}\n')
  assert [p["prompt"] for p in chat.read_prompt_jsonl(str(jsonl))] == ["hi"]


def test_out_of_memory_is_one_decode_error_naming_the_flags():
  """XLA's RESOURCE_EXHAUSTED while decoding (--num_samples 65536 on a
  memory-capped host) becomes a DecodeError naming the flags that size the
  batch; other runtime errors pass unchanged."""
  import jax
  from decode.cli.run import out_of_memory_as_decode_error
  oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 2147483648 bytes.")
  with pytest.raises(DecodeError, match=r"2 prompt\(s\) x --num_samples=65536 rows.*lower "
                     r"--num_samples"):
    with out_of_memory_as_decode_error(2, 65536, 64):
      raise oom
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
    with out_of_memory_as_decode_error(2, 65536, 64):
      raise jax.errors.JaxRuntimeError("INTERNAL: something else")
