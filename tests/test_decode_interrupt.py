"""python -m decode generates its answer once (a warm-up of one token per row
compiles first) and a Ctrl-C during the decoding keeps what was generated:
the text so far, the statistics and the report marked interrupted, exit
status 130, no traceback."""

import io
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from decode import loops
from decode.cli.run import DecodeRequest, run
from decode.decoder import WARMUP_TOKENS, Decoder, SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATS_KEYS = {"mean_accepted_length", "acceptance_rate_per_position", "accepted_length_histogram",
              "target_calls", "num_tokens", "ttft_s", "itl_p50_s", "itl_p90_s", "tokens_per_s",
              "wall_time_s", "prefill_s", "decode_tokens_per_s"}
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@pytest.fixture(scope="module")
def workdir(markov_workdir):
  return markov_workdir


class Tally:
  """What one ``run`` decoded: new tokens (the most of any row) per
  ``stream_rounds`` call, ``Decoder.stream`` calls without a ``budget``
  (not a warm-up) and not inside one ("auto"'s AR fallback), and XLA
  compilations made inside them (the timed, streamed generation)."""

  def __init__(self, monkeypatch):
    self.tokens, self.streams, self.compiles_in_stream = [], 0, 0
    self._in_stream = False
    real_rounds, real_stream = loops.stream_rounds, Decoder.stream

    def stream_rounds(step, state, max_new_tokens, **kw):
      start = np.asarray(state.length)
      out = real_rounds(step, state, max_new_tokens, **kw)
      self.tokens.append(int((np.asarray(out[0].length) - start).max()))
      return out

    def stream(dec, *a, **k):
      if k.get("budget") is not None or self._in_stream:   # a warm-up; the fallback's
        return real_stream(dec, *a, **k)
      self.streams += 1
      self._in_stream = True
      try:
        return real_stream(dec, *a, **k)
      finally:
        self._in_stream = False

    def on_compile(event, duration, **_):
      if event == COMPILE_EVENT and self._in_stream:
        self.compiles_in_stream += 1
    monkeypatch.setattr(loops, "stream_rounds", stream_rounds)
    monkeypatch.setattr(Decoder, "stream", stream)
    jax.monitoring.register_event_duration_secs_listener(on_compile)
    self._listener = on_compile

  def close(self):
    jax.monitoring.unregister_event_duration_listener(self._listener)


@pytest.mark.parametrize("method,g,stop,drafts", [
    ("ar", 1, (), None), ("mtp", 2, (), None), ("mtp", "auto", (), True),
    ("mtp", "auto", (), False), ("mtp", 2, ("zz",), None)])
def test_the_answer_is_generated_once_after_a_warm_up_of_one_token(workdir, monkeypatch, method,
                                                                   g, stop, drafts):
  """One ``run`` (what ``python -m decode`` does) decodes its answer once:
  one ``Decoder.stream`` call, and besides it only a warm-up whose rows stop
  after ``WARMUP_TOKENS``; the warm-up compiled everything, so the timed,
  streamed generation compiles nothing (with "auto" whether it drafts or
  runs its AR fallback, ``drafts``; with a stop string, the cut too). The
  statistics keep their keys."""
  from decode.auto.schedule import AutoSchedule
  from decode.stops import StopConditions
  if drafts is not None:
    monkeypatch.setattr(AutoSchedule, "drafting_pays", lambda self, *a, **k: drafts)
  tally = Tally(monkeypatch)
  out, err = io.StringIO(), io.StringIO()
  try:
    report = run(DecodeRequest(workdir, ["abca"], method=method, num_draft_tokens=g,
                               max_new_tokens=40, sampling=SamplingParams(temperature=0.0),
                               stops=StopConditions(strings=stop) if stop else None), out=out,
                               err=err).to_json()
  finally:
    tally.close()
  (res,) = report["results"]
  assert tally.streams == 1
  assert len(tally.tokens) == 2, tally.tokens               # the warm-up, then the answer
  assert tally.tokens[0] <= WARMUP_TOKENS <= 5
  assert tally.tokens[1] == len(res["tokens"]) == 40
  assert tally.compiles_in_stream == 0
  s = report["stats"]
  assert STATS_KEYS <= set(s) and "interrupted" not in s and "interrupted" not in report
  assert s["num_tokens"] == 40 and 0 < s["prefill_s"] <= s["ttft_s"] <= s["wall_time_s"]
  assert out.getvalue() == "abca" + res["text"] + "\n" and res["finish_reason"] == "length"
  if drafts is not None:
    assert (sum(s["draft_length_histogram"][1:]) > 0) == drafts


class RaisingOut(io.StringIO):
  """stdout whose ``at``-th write raises KeyboardInterrupt (and is lost), as a
  Ctrl-C landing inside the streamed text's callback would."""

  def __init__(self, at: int):
    super().__init__()
    self.at, self.writes = at, 0

  def write(self, text):
    self.writes += 1
    if self.writes == self.at:
      raise KeyboardInterrupt
    return super().write(text)


def test_an_interrupt_in_the_text_callback_keeps_the_text_so_far(workdir):
  """A KeyboardInterrupt raised while a round's text is handed on ends the
  generation there: the printed text and the report's agree (what was
  printed before the interrupted round), the statistics and the report are
  marked interrupted, the row's finish reason is "interrupted", and
  --compare is skipped."""
  out, err = RaisingOut(at=5), io.StringIO()     # write 1: the prompt; 2-4: three rounds' text
  try:
    report = run(DecodeRequest(workdir, ["abca"], method="mtp", num_draft_tokens=2,
                               max_new_tokens=60, sampling=SamplingParams(temperature=0.0),
                               compare=True), out=out, err=err).to_json()
  except KeyboardInterrupt:       # pytest would end the session on it
    pytest.fail("the KeyboardInterrupt escaped run(): nothing kept")
  (res,) = report["results"]
  assert report["interrupted"] is True and report["stats"]["interrupted"] is True
  assert res["finish_reason"] == "interrupted" and 3 <= len(res["tokens"]) <= 9
  assert out.getvalue() == "abca" + res["text"] + "\n"
  assert report["stats"]["num_tokens"] == len(res["tokens"])
  assert "speedup" not in report and "ar_stats" not in report
  text = err.getvalue()
  assert "(interrupted" in text and "--compare skipped" in text


def test_without_interruptible_a_keyboard_interrupt_propagates(trained_markov):
  """The library's ``stream`` keeps Python's behaviour unless asked:
  a KeyboardInterrupt from a callback propagates."""
  from mtp.tokenizer import ByteTokenizer
  _, model, _ = trained_markov

  def on_text(row, data):
    raise KeyboardInterrupt
  dec = Decoder(model, "mtp", 2)
  prompt = [np.asarray(ByteTokenizer().encode("ab", add_bos=True), np.int32)]
  with pytest.raises(KeyboardInterrupt):
    dec.stream(prompt, 8, SamplingParams(0.0), on_text=on_text)
  gen = dec.stream(prompt, 8, SamplingParams(0.0), on_text=on_text, interruptible=True)
  assert gen.interrupted and len(gen.tokens[0]) == 0 and gen.finish_reasons == ["interrupted"]


# python -m decode with a patch applied first: ``SIGINT_AT_ROUND`` sends the
# process a real SIGINT (Ctrl-C) from inside the 3rd round of a stream; the
# warm-up runs one round, so it lands in the answer's stream
# A terminal's Ctrl-C: the child starts with Python's own SIGINT handler even
# when the test runs in an xdist worker, whose children inherit SIGINT ignored
# (then Python installs no handler and a SIGINT does nothing, as under nohup).
RUNNER = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from decode import loops
import decode.cli.run
real = loops.stream_rounds
def stream_rounds(step, *a, **k):
  n = [0]
  def counted(s):
    n[0] += 1
    if n[0] == 3:
      os.kill(os.getpid(), signal.SIGINT)
    return step(s)
  return real(counted, *a, **k)
def load_decoder(*a, **k):
  raise KeyboardInterrupt
if os.environ["PATCH"] == "sigint_at_round":
  loops.stream_rounds = stream_rounds
else:
  decode.cli.run.load_decoder = load_decoder
from absl import app
from mtp.cli import parse_flags_or_exit
from decode.__main__ import main, reporting_interrupts
sys.argv = ["decode"] + sys.argv[1:]
app.run(reporting_interrupts(main), flags_parser=parse_flags_or_exit)
"""


def _cli(patch, *args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PATCH": patch}
  return subprocess.run([sys.executable, "-c", RUNNER, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


def test_ctrl_c_while_decoding_exits_130_with_the_text_stats_and_report(workdir, tmp_path):
  """A real SIGINT during the answer's third round: the round finishes, the
  loop stops at its boundary, the text so far is on stdout, the statistics
  (marked interrupted) on stderr, the --json report says interrupted, the
  exit status is 130 and there is no traceback."""
  path = tmp_path / "r.json"
  r = _cli("sigint_at_round", "--workdir", workdir, "--prompt", "abca", "--method", "mtp",
           "--num_draft_tokens", "2", "--temperature", "0", "--max_new_tokens", "60",
           "--json", str(path))
  assert r.returncode == 130, r.stderr[-3000:]
  assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr
  report = json.loads(path.read_text())
  (res,) = report["results"]
  assert report["interrupted"] is True and report["stats"]["interrupted"] is True
  assert 3 <= len(res["tokens"]) <= 9 and res["finish_reason"] == "interrupted"
  assert r.stdout == "abca" + res["text"] + "\n"
  assert "[mtp] tokens" in r.stderr and "(interrupted" in r.stderr


def test_ctrl_c_before_decoding_exits_130_without_a_traceback(workdir, tmp_path):
  """A KeyboardInterrupt before anything was decoded (here while loading):
  one line, exit status 130, no traceback, and a report that says so."""
  path = tmp_path / "r.json"
  r = _cli("interrupt_loading", "--workdir", workdir, "--prompt", "abca", "--json", str(path))
  assert r.returncode == 130, r.stderr[-3000:]
  assert "Traceback" not in r.stderr and "interrupted: no result to report" in r.stderr
  report = json.loads(path.read_text())
  assert report["interrupted"] is True and report["results"] == [] and "meta" in report
  assert r.stdout == ""
