"""Benchmarks run end to end on tiny sizes and write well-formed output
(timings are not asserted: they belong to the scripts, not the tests)."""

import importlib
import json
import os

import numpy as np
import pytest

from tests.conftest import md_command


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name):
  """scripts/NAME.py as the module ``scripts.NAME`` (the repository root is on sys.path)."""
  return importlib.import_module(f"scripts.{name}")


def _experiment(name):
  """experiments/NAME.py as the module ``experiments.NAME``."""
  return importlib.import_module(f"experiments.{name}")


@pytest.fixture(scope="module")
def workdir(markov_workdir):
  return markov_workdir


@pytest.mark.slow
def test_bench_decode_quick(workdir, data_dir, tmp_path):
  out = str(tmp_path / "bd")
  argv = ["--workdir", workdir, "--quick", "--data_dir", data_dir, "--draft_workdir", workdir,
          "--num_draft_tokens", "1,auto", "--out", out]
  _script("bench_decode").main(argv)
  assert md_command(out + ".md") == "python scripts/bench_decode.py " + " ".join(argv)
  report = json.load(open(out + ".json"))
  assert {"commit", "jax_version", "device_kind", "cpu_count", "date", "config"} <= set(report["meta"])
  names = {(r["method"], r["form"], r["temperature"], r["num_draft_tokens"]) for r in report["results"]}
  assert {("ar", "while", 0.0, 0), ("mtp", "stream", 1.0, 1), ("draft", "while", 1.0, 1),
          ("mtp", "while", 0.0, "auto")} <= names
  assert ("draft", "while", 1.0, "auto") not in names       # auto drafts with MTP modules only
  for r in report["results"]:
    assert r["tokens_per_s"] > 0 and r["tau"] >= 1 and r["speedup_decode"] > 0
    assert 0 < r["prefill_s_median"] < r["wall_s_median"]
    if r["num_draft_tokens"] == "auto":
      hist = r["draft_length_histogram"]
      assert len(hist) == 3 and sum(hist) > 0              # G_max = D = 2
      assert "ideal_speedup" not in r
      assert len(r["auto"]["round_costs_s"]) >= 1 and len(r["auto"]["prior"]) >= 1
    elif r["method"] != "ar":
      assert r["ideal_speedup"] > 0 and r["efficiency"] > 0
      assert 0 < r["draft_cost_ratio_c_flops"] < 5
  md = open(out + ".md").read().splitlines()
  main_table = md[md.index(next(l for l in md if l.startswith("| T | B |"))) + 2:]
  rows = [l for l in main_table if l.startswith("| ")]
  assert len(rows) == len(report["results"])
  bare = report["meta"]["bare_forward_in_loop_s_by_batch"]["1"]
  assert set(bare) == {"1", "2"} and all(v > 0 for v in bare.values())
  assert any(l.startswith("| 1 | ") for l in md[:md.index(next(l for l in md if l.startswith("| T | B |")))])
  notes = [l for l in md if l.startswith("- T = ") and "round costs `auto` held" in l]
  assert len(notes) == sum(r["num_draft_tokens"] == "auto" for r in report["results"]), md


def test_bench_train_quick(tmp_path):
  out = str(tmp_path / "bt")
  argv = ["--config", os.path.join(REPO, "configs/tiny.py"), "--quick", "--depths", "0,1",
          "--out", out]
  _experiment("bench_train").main(argv)
  assert md_command(out + ".md") == "python -m experiments.bench_train " + " ".join(argv)
  rows = json.load(open(out + ".json"))["results"]
  assert [r["depth"] for r in rows] == [0, 1]
  assert rows[0]["time_ratio"] == 1.0 and rows[1]["flop_ratio"] > 1.0


def test_bench_round_quick(workdir, data_dir, tmp_path):
  """The round-cost breakdown attributes profiled operations to the named
  scopes of the round (module, head, sample, verify, accept, commit)."""
  out = str(tmp_path / "br")
  argv = ["--workdir", workdir, "--quick", "--data_dir", data_dir, "--num_draft_tokens", "2",
          "--out", out]
  _experiment("bench_round").main(argv)
  assert md_command(out + ".md") == "python -m experiments.bench_round " + " ".join(argv)
  rows = json.load(open(out + ".json"))["results"]
  assert [(r["temperature"], r["num_draft_tokens"]) for r in rows] == [(0, 0), (0, 2), (1, 0), (1, 2)]
  for r in rows:
    pieces = r["pieces"]
    assert pieces["verify/forward"]["ops_per_round"] > 0 and r["round_us"] > 0
    if r["num_draft_tokens"]:
      assert {"draft/module1", "draft/module2", "draft/head", "accept", "commit"} <= set(pieces)
      assert 0 < r["draft_share"] < 1
    if r["temperature"] == 0:       # greedy: no softmax, no sampling, no random numbers
      assert "rng" not in pieces and "verify/warp" not in pieces and "draft/sample" not in pieces or \
          pieces["draft/sample"]["ops_per_round"] <= r["num_draft_tokens"]
    else:
      assert pieces["draft/sample"]["ops_per_round"] > 0 if r["num_draft_tokens"] else True
  md = open(out + ".md").read()
  assert "| verify/forward |" in md and "round, unprofiled" in md


def test_bench_draft_cost_quick(tmp_path):
  out = str(tmp_path / "dc")
  argv = ["--config", os.path.join(REPO, "configs/tiny.py"), "--quick", "--layers", "1,4",
          "--out", out]
  _experiment("bench_draft_cost").main(argv)
  assert md_command(out + ".md") == "python -m experiments.bench_draft_cost " + " ".join(argv)
  rows = json.load(open(out + ".json"))["results"]
  assert [r["layers"] for r in rows] == [1, 4]
  # one module next to 1 layer costs more of a target step than next to 4 layers
  assert rows[0]["c_flops"] > rows[1]["c_flops"] > 0
  assert all(r["c"] > 0 for r in rows) and os.path.getsize(out + ".png") < 150_000


# -- shared command-line and report helpers (mtp/cli.py, mtp/report.py) -------------------

import argparse  # noqa: E402

from mtp import cli, report  # noqa: E402


def _ap():
  return argparse.ArgumentParser(prog="x")


def test_parse_list_values_and_errors(capsys):
  ap = _ap()
  assert cli.parse_list(ap, "t", "0, 1,1,0.5", float, 0.0) == [0.0, 1.0, 0.5]   # duplicates dropped
  assert cli.parse_list(ap, "f", "while", str, choices=("while", "stream")) == ["while"]
  assert cli.parse_list(ap, "p", "1", float, 0.0, 1.0, lo_open=True) == [1.0]
  for args, needle in [(("d", "", int, 0, 16), "--d=''"), (("d", "0,17", int, 0, 16), "in [0, 16]"),
                       (("d", "x", int, 0), "comma list of integers"), (("t", "nan", float, 0.0), ">= 0"),
                       (("p", "0", float, 0.0, 1.0), "in (0, 1]"),
                       (("f", "bogus", str), "one of while, stream"),
                       (("s", "0,0", int, 0), "duplicate"),
                       (("t", "0.9,,0.8", float, 0.0), "item 2 is empty"),
                       (("t", "1,", float, 0.0), "item 2 is empty")]:
    kw = {"lo_open": True} if args[0] == "p" else {"choices": ("while", "stream")} if args[0] == "f" else {}
    if args[0] == "s":
      kw = {"duplicates": "error"}
    with pytest.raises(SystemExit) as e:
      cli.parse_list(ap, *args, **kw)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--{args[0]}=" in err and needle in err, err


def test_list_items_refuses_empty_items(capsys):
  """String comma lists (categories, trees, shapes, baselines) are refused
  with an empty item, as parse_list's are, not silently shortened."""
  ap = _ap()
  assert cli.list_items(ap, "categories", " code, qa ") == ["code", "qa"]
  for text, needle in (("code,,qa", "item 2 is empty"), ("code,", "item 2 is empty"),
                       ("", "empty"), (" , ", "empty")):
    with pytest.raises(SystemExit) as e:
      cli.list_items(ap, "categories", text)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--categories=" in err and needle in err, err
  with pytest.raises(ValueError, match="--trees='3,,2': item 2 is empty"):
    cli.split_items("trees", "3,,2")


def test_apply_quick_keeps_given_values():
  ap = _ap()
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--temperatures", default="0,1")
  args = ap.parse_args(["--temperatures", "-1"])
  cli.apply_quick(ap, args, repeats=1, temperatures="0")
  assert (args.repeats, args.temperatures) == (1, "-1")


def test_exit_if_interrupted(capsys, tmp_path):
  cli.exit_if_interrupted({"step": 10, "interrupted": False, "signal": None}, 10, "run", str(tmp_path))
  for sig, code in ((2, 130), (15, 143)):
    with pytest.raises(SystemExit) as e:
      cli.exit_if_interrupted({"step": 3, "interrupted": True, "signal": sig}, 10, "draft run x",
                                 str(tmp_path))
    assert e.value.code == code
    err = capsys.readouterr().err
    assert "draft run x" in err and "resume" in err and "step 3 of 10" in err


def test_provenance_has_cpu_model(monkeypatch):
  meta = report.provenance()
  assert meta["cpu_model"] and meta["platform"] and "CPUs: " in report.machine(meta)
  assert meta["commit"] == report.COMMIT_AT_START
  # a commit made while a script ran: the start's commit is reported, the new one beside it
  monkeypatch.setattr(report, "git_commit", lambda: "abc1234")
  meta = report.provenance()
  assert meta["commit"] == report.COMMIT_AT_START and meta["commit_at_write"] == "abc1234"
  assert report.plural(1, "repeat") == "1 repeat" and report.plural(2, "repeat") == "2 repeats"


@pytest.mark.parametrize("name,flags,needle", [
    ("bench_decode", ["--temperatures", ""], "--temperatures"),
    ("bench_decode", ["--batch_sizes", "0"], "--batch_sizes"),
    ("bench_decode", ["--repeats", "0"], "--repeats"),
    ("bench_decode", ["--forms", "bogus"], "--forms"),
    ("bench_decode", ["--max_new_tokens", "0"], "--max_new_tokens"),
    ("bench_decode", ["--num_draft_tokens", "0"], "--num_draft_tokens"),
    ("bench_decode", ["--quick", "--temperatures", "-1"], "--temperatures"),   # --quick keeps given flags
    ("bench_train", ["--depths", ""], "--depths"),
    ("bench_train", ["--steps", "0"], "--steps"),
    ("bench_train", ["--depths", "-1"], "--depths"),
    ("bench_train", ["--config", "/nonexistent/config.py"], "--config"),
    ("bench_draft_cost", ["--layers", "0"], "--layers"),
    ("bench_draft_cost", ["--repeats", "0"], "--repeats"),
    ("bench_draft_cost", ["--max_new_tokens", "0"], "--max_new_tokens"),
    ("bench_draft_cost", ["--config", "/nonexistent/config.py"], "--config"),
])
def test_bench_bad_flags_fail_before_loading(name, flags, needle, capsys, tmp_path):
  """Validation comes first: the workdir does not exist, so reaching the
  model load would raise CheckpointError instead of exiting with status 2."""
  argv = (["--workdir", str(tmp_path / "nonexistent")] if name == "bench_decode" else []) + flags
  with pytest.raises(SystemExit) as e:
    module = _script(name) if name == "bench_decode" else _experiment(name)
    module.main(argv + ["--out", str(tmp_path / "x")])
  assert e.value.code == 2
  assert needle in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "x.json")


def test_main_guard_one_line_error(capsys, tmp_path):
  with pytest.raises(SystemExit) as e:
    cli.main_guard(_script("bench_decode").main, ["--workdir", str(tmp_path / "nope"), "--quick"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: CheckpointError") and "Traceback" not in err and err.count("\n") == 1


def test_help_keeps_usage_lines_and_defaults(capsys):
  with pytest.raises(SystemExit):
    _script("bench_decode").main(["--help"])
  out = capsys.readouterr().out
  assert "[--draft_workdir DIR] \\\n" in out                  # raw docstring: the line break stays
  assert "(default: 5)" in out and "tensorflow_datasets" in out


def test_markdown_starts_with_the_quoted_command(tmp_path):
  script = os.path.join(REPO, "scripts", "bench_decode.py")
  cmd = report.command_line(script, ["--prompt", "it's `x`", "--quick"])
  assert cmd == "python scripts/bench_decode.py --prompt 'it'\"'\"'s `x`' --quick"
  report.write_report(str(tmp_path / "r"), {"command": cmd}, [], "# Title\n")
  text = open(tmp_path / "r.md").read()
  assert text == f"Command: ``{cmd}``\n\n# Title\n"      # a fence longer than the backticks inside
  with pytest.raises(ValueError, match="command"):
    report.write_report(str(tmp_path / "s"), {}, [], "# Title\n")


def test_experiments_record_the_command_as_a_module():
  """An experiment's OUT.md records ``python -m experiments.NAME ARG ...``,
  which runs from the repository root whether or not the package is
  installed; the arguments are quoted as ``report.command_line`` quotes."""
  from experiments import common
  path = os.path.join(REPO, "experiments", "bench_train.py")
  assert common.command_line(path, []) == "python -m experiments.bench_train"
  assert common.command_line(path, ["--out", "a b", "--quick"]) == \
      "python -m experiments.bench_train --out 'a b' --quick"


@pytest.mark.parametrize("room", ["scripts", "experiments"])
def test_scripts_import_scripts_by_absolute_name_and_leave_sys_path_alone(room):
  """A script (or experiment) runs both as ``python ROOM/NAME.py`` (the
  package installed) and as ``python -m ROOM.NAME``: it imports another
  module of its room only by its absolute name (``ROOM.X``; a relative
  import fails under the first form, a bare sibling name under the second)
  and never edits sys.path. (No cycle among them: tests/test_import_graph.py.)"""
  import ast
  import glob
  siblings = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, room, "*.py"))}
  for path in glob.glob(os.path.join(REPO, room, "*.py")):
    src = open(path).read()
    assert "sys.path" not in src, path
    for node in ast.walk(ast.parse(src)):
      if isinstance(node, ast.ImportFrom):
        assert not node.level, (path, node.module)
        names = [node.module or ""]
      elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      else:
        continue
      assert not any(n.split(".")[0] in siblings for n in names), (path, names)


def test_bench_cells_defaults_and_refusals():
  from scripts.bench_lib import bench_cells
  kw = dict(gs_given=None, trees_text=None, ar_only=False, quick=False)
  assert bench_cells("w", 2, False, **kw) == ([1, 2, 3, 4, "auto"], [])
  assert bench_cells("w", 0, True, **kw) == ([1, 2], [])
  assert bench_cells("w", 2, False, **{**kw, "quick": True}) == ([1], [])
  assert bench_cells("w", 2, False, **{**kw, "gs_given": [3], "quick": True}) == ([3], [])
  assert bench_cells("w", 0, False, **{**kw, "ar_only": True}) == ([], [])
  assert bench_cells("w", 2, False, **{**kw, "trees_text": "2,1; 1,1"}) == (
      [1, 2, 3, 4, "auto"], [(2, 1), (1, 1)])
  for depth, draft, extra, needle in [
      (0, False, {}, "no drafter to compare"), (0, True, {"trees_text": "2"}, "--trees needs"),
      (2, False, {"trees_text": ";"}, "--trees: tree"),
      (0, True, {"gs_given": ["auto"]}, "auto drafts with the MTP modules")]:
    with pytest.raises(ValueError, match=needle):
      bench_cells("w", depth, draft, **{**kw, **extra})


def test_quick_runs_never_overwrite_the_committed_reports(tmp_path, monkeypatch):
  """``--quick`` with ``--out`` at its default writes under runs/quick/
  (a smoke run once rewrote results/simulate_speedup.json), whose folder it
  makes; a given ``--out`` is kept, and a full run keeps results/."""
  import argparse
  monkeypatch.chdir(tmp_path)       # the folder is made relative to the working directory
  from mtp import cli
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="results/simulate_speedup")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--rounds", type=int, default=10)
  args = ap.parse_args(["--quick"])
  cli.apply_quick(ap, args, rounds=2)
  assert args.out == os.path.join("runs", "quick", "simulate_speedup") and args.rounds == 2
  assert os.path.isdir(tmp_path / "runs" / "quick")
  args = ap.parse_args(["--quick", "--out", "elsewhere/x"])
  cli.apply_quick(ap, args, rounds=2)
  assert args.out == "elsewhere/x"
  args = ap.parse_args([])
  cli.quick_out(ap, args)
  assert args.out == "results/simulate_speedup"


def test_bench_auto_fallback_rebuilds_its_ratios(workdir, tmp_path):
  """The fallback benchmark runs "auto" with costs that make every draft
  lose (it asserts the fallback drafted nothing and matched AR's tokens),
  and every printed ratio rebuilds from the walls in its JSON."""
  prompts = tmp_path / "p.txt"
  prompts.write_text("abc de\nfa b\n")
  out = str(tmp_path / "fb")
  argv = ["--workdir", workdir, "--prompt_file", str(prompts), "--batch_sizes", "1,2",
          "--max_new_tokens", "4", "--repeats", "2", "--out", out]
  _experiment("bench_auto_fallback").main(argv)
  assert md_command(out + ".md") == "python -m experiments.bench_auto_fallback " + " ".join(argv)
  rows = json.load(open(out + ".json"))["results"]["batches"]
  assert [r["batch_size"] for r in rows] == [1, 2]
  md = open(out + ".md").read()
  for r in rows:
    ar, fb, s = np.array(r["ar_s"]), np.array(r["fallback_s"]), r["speedup"]
    np.testing.assert_allclose(s["per_repeat"], ar / fb)
    assert s["median"] == pytest.approx(np.median(ar / fb))
    assert (s["min"], s["max"]) == (pytest.approx((ar / fb).min()), pytest.approx((ar / fb).max()))
    assert s["ratio_of_medians"] == pytest.approx(np.median(ar) / np.median(fb))
    assert r["new_tokens"] == 4 * r["batch_size"]
    assert f"| {r['batch_size']} | {r['new_tokens']} | {np.median(ar) * 1e3:.1f} ms |" in md
    assert f"{s['median']:.3f}x ({s['min']:.3f}-{s['max']:.3f}x) | {s['ratio_of_medians']:.3f}x |" in md
