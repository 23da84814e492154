"""Held-out evaluation by category (issue 22): ``--prompt_file`` reads JSONL
chat prompts (errors name the line), ``run`` renders them with the chat
template (system message included) and reports tau / alpha_k / tokens (and
the speedup with compare) per category; ``decode.cli.stats`` groups rows."""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from decode.cli import stats as stats_lib
from decode.cli.run import DecodeRequest, encode_prompts, read_prompts, run
from decode.decoder import DecodeError
from decode.state import Generation
from mtp import tokenizer as tok
from tests import tiny_bpe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bpe_workdir(tmp_path_factory):
  return tiny_bpe.import_tiny_workdir(str(tmp_path_factory.mktemp("cat_wd")), mtp_depth=1)


def _gen(hists, tokens):
  """A hand-built Generation: rows' accepted-length histograms (G = 2)."""
  h = np.asarray(hists, np.int64)
  return Generation(tokens=[np.zeros(n, np.int32) for n in tokens], prompt_lengths=np.ones(len(h)),
                    accepted_histogram=h, target_calls=h.sum(1), emit_times=None,
                    wall_time_s=1.0, num_draft_tokens=2)


def test_group_rows_and_summary_by_category():
  assert stats_lib.group_rows(["code", "math", "code", None, ""]) == {
      "code": [0, 2], "math": [1], "(none)": [3, 4]}
  gen = _gen([[1, 0, 1], [0, 2, 0], [1, 1, 0]], [4, 4, 3])
  per = stats_lib.summarize_by_category(gen, ["a", "b", "a"], speedups={"a": 1.5})
  assert list(per) == ["a", "b"]
  assert per["a"]["rows"] == 2 and per["a"]["num_tokens"] == 7 and per["a"]["target_calls"] == 4
  assert per["a"]["accepted_length_histogram"] == [2, 1, 1]
  assert per["a"]["mean_accepted_length"] == pytest.approx((2 * 1 + 1 * 2 + 1 * 3) / 4)
  assert per["a"]["acceptance_rate_per_position"] == pytest.approx([2 / 4, 1 / 2])
  assert per["b"]["acceptance_rate_per_position"] == pytest.approx([1.0, 0.0])
  assert per["a"]["speedup"] == 1.5 and "speedup" not in per["b"]
  table = stats_lib.format_by_category(per)
  assert "a" in table and "speedup 1.50x" in table and "tau 2.000" in table
  with pytest.raises(ValueError, match="2 categories for 3 rows"):
    stats_lib.summarize_by_category(gen, ["a", "b"])


@pytest.mark.parametrize("lines, needle", [
    (['{"prompt": "a"}', "{bad json"], "line 2 is not valid JSON"),
    (['{"category": "math"}'], 'line 1: missing field "prompt"'),
    (['{"prompt": "a", "answer": "b"}'], r"line 1: unknown field\(s\) \['answer'\]"),
])
def test_prompt_file_jsonl_errors(tmp_path, lines, needle):
  path = tmp_path / "p.jsonl"
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(DecodeError, match=needle) as e:
    read_prompts(str(path))
  assert "--prompt_file" in str(e.value) and "\n" not in str(e.value)


def test_prompt_file_txt_unchanged(tmp_path):
  path = tmp_path / "p.txt"
  path.write_text('{"prompt": "a"}\nsecond\n')
  assert read_prompts(str(path)) == ['{"prompt": "a"}', "second"]


def test_system_message_goes_before_the_user_message(bpe_workdir):
  tk = tok.load_tokenizer(bpe_workdir)
  ids = encode_prompts(["hello"], tk, chat=True, systems=["be brief"])[0]
  want = tk.apply_chat_template([{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": "hello"}])
  np.testing.assert_array_equal(ids, want)
  with pytest.raises(DecodeError, match="system message, which needs the chat template"):
    encode_prompts(["hello"], tk, chat=False, systems=["be brief"])


@pytest.mark.slow
def test_run_reports_per_category(bpe_workdir):
  prompts = [{"category": "code", "prompt": "def f(x):"},
             {"category": "math", "prompt": "2 + 2 =", "system": "Answer with a number."},
             {"category": "code", "prompt": "import os"}, {"category": "math", "prompt": "3 * 3"}]
  err = io.StringIO()
  report = run(DecodeRequest(bpe_workdir, prompts, method="mtp", num_draft_tokens=1,
                             max_new_tokens=4, compare=True, repeats=1, chat=None),
               out=io.StringIO(), err=err).to_json()
  assert report["config"]["chat"] is True
  assert [r["category"] for r in report["results"]] == ["code", "math", "code", "math"]
  per = report["per_category"]
  assert list(per) == ["code", "math"] and per["code"]["rows"] == 2
  assert per["code"]["num_tokens"] + per["math"]["num_tokens"] == report["stats"]["num_tokens"]
  assert all(v["speedup"] > 0 for v in per.values())
  assert "per category:" in err.getvalue()
  json.dumps(report)


@pytest.mark.cpu_only
def test_cli_prompt_file_jsonl(bpe_workdir, tmp_path):
  path = tmp_path / "h.jsonl"
  path.write_text('{"category": "qa", "prompt": "hi"}\n{"category": "qa", "prompt": "yo"}\n')
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = tmp_path / "r.json"
  r = subprocess.run([sys.executable, "-m", "decode", "--workdir", bpe_workdir, "--prompt_file",
                      str(path), "--method", "ar", "--max_new_tokens", "3", "--json", str(out)],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  assert json.loads(out.read_text())["per_category"]["qa"]["rows"] == 2
  path.write_text('{"category": "qa", "prompt": "hi"}\n{"prompt": 5}\n')
  r = subprocess.run([sys.executable, "-m", "decode", "--workdir", bpe_workdir, "--prompt_file",
                      str(path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 2 and 'line 2: field "prompt" must be a string' in r.stderr
