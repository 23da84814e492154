"""Decoding statistics (definitions: docs/design.md section 7; the theory
they are compared with: ``decode.cli.theory``). ``summarize`` gives tau
(``mean_accepted_length``: mean a+1 over rounds, a = accepted drafts, a
tree's accepted path length), the printed tau (``tokens_per_call``: emitted
tokens / target calls, summed over rows), alpha_k = P(a >= k | a >= k-1)
(with "auto" from per-position counts), TTFT, ITL, throughput and the
decoding phase's rate; ``format_summary`` and ``format_by_category`` print
them. Times in seconds."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from decode.tree_spec import TreeSpec



def acceptance_rates(histogram: np.ndarray) -> list[float | None]:
  """alpha_k for k = 1..G from a histogram [G+1] of accepted counts (None
  where no round reached position k)."""
  h = np.asarray(histogram, np.float64)
  g = len(h) - 1
  reach = np.cumsum(h[::-1])[::-1]          # reach[j] = rounds with a >= j
  return [float(reach[k] / reach[k - 1]) if reach[k - 1] > 0 else None for k in range(1, g + 1)]


def summarize(gen, rows: Sequence[int] | None = None) -> dict:
  """Statistics over ``rows`` (default: all) of a ``Generation``. Keys:
  mean_accepted_length, acceptance_rate_per_position,
  accepted_length_histogram, target_calls, num_tokens, tokens_per_call,
  ttft_s, itl_p50_s, itl_p90_s, tokens_per_s, wall_time_s, prefill_s,
  decode_tokens_per_s (timing keys None in the while_loop form), tree
  (branching or None), nodes_per_round (N, G, 0 for AR, None with "auto"),
  and ``interrupted`` (True) only when an interrupt ended it early."""
  rows = list(range(len(gen.tokens))) if rows is None else list(rows)
  hist = gen.accepted_histogram[rows].sum(0)
  if gen.position_tested is not None:            # "auto": rounds had different G
    tested, passed = gen.position_tested[rows].sum(0), gen.position_accepted[rows].sum(0)
    alphas = [float(p / t) if t else None for p, t in zip(passed, tested)]
  else:
    alphas = acceptance_rates(hist)
  calls = int(gen.target_calls[rows].sum())
  num_tokens = int(sum(len(gen.tokens[i]) for i in rows))
  verified = float((hist * (np.arange(len(hist)) + 1)).sum())
  out = {
      "mean_accepted_length": verified / calls if calls else None,
      "acceptance_rate_per_position": alphas,
      "accepted_length_histogram": [int(x) for x in hist],
      "target_calls": calls,
      "num_tokens": num_tokens,
      "tokens_per_call": num_tokens / calls if calls else None,
      "ttft_s": None, "itl_p50_s": None, "itl_p90_s": None,
      "tokens_per_s": num_tokens / gen.wall_time_s if gen.wall_time_s > 0 else None,
      "wall_time_s": gen.wall_time_s,
      "prefill_s": gen.prefill_time_s,
      "decode_tokens_per_s": (num_tokens / (gen.wall_time_s - gen.prefill_time_s)
                              if gen.wall_time_s > gen.prefill_time_s else None),
      "draft_length_histogram": (None if gen.draft_length_histogram is None else
                                 [int(x) for x in gen.draft_length_histogram[rows].sum(0)]),
      "tree": None if gen.tree is None else list(gen.tree),
      "nodes_per_round": (TreeSpec(gen.tree).num_nodes if gen.tree is not None
                          else None if gen.draft_length_histogram is not None
                          else gen.num_draft_tokens),
  }
  if getattr(gen, "interrupted", False):
    out["interrupted"] = True
  if gen.emit_times is not None:
    firsts = [gen.emit_times[i][0] for i in rows if gen.emit_times[i]]
    gaps = np.concatenate([np.diff(gen.emit_times[i]) for i in rows if len(gen.emit_times[i]) > 1]
                          or [np.zeros(0)])
    out["ttft_s"] = float(np.median(firsts)) if firsts else None
    if gaps.size:
      out["itl_p50_s"] = float(np.percentile(gaps, 50))
      out["itl_p90_s"] = float(np.percentile(gaps, 90))
  return out


def format_summary(name: str, s: dict, timing: bool = True,
                   timing_note: str = "this answer's run is not one of --compare's timed "
                                      "repeats; see their blocks") -> str:
  """Human-readable block for the CLI; tau is ``tokens_per_call``, with
  ``mean_accepted_length`` beside it where a cut makes them differ.
  ``timing`` False replaces the timing line (TTFT, ITL, throughput, wall)
  by ``timing_note`` (``--compare`` prints its timed blocks after)."""
  num = lambda x, spec: "n/a" if x is None else format(x, spec)
  ms = lambda x: "n/a" if x is None else f"{x * 1e3:.2f} ms"
  alphas = ", ".join(f"alpha_{k}={num(a, '.3f')}" for k, a in
                     enumerate(s["acceptance_rate_per_position"], 1)) or "n/a (AR)"
  tree = s.get("tree")
  tau = s.get("tokens_per_call")
  whole = s["mean_accepted_length"]
  head = f"[{name}] tokens {s['num_tokens']}  target calls {s['target_calls']}  " \
         f"tau {num(tau, '.3f')} (tokens / target calls"
  if tau is not None and whole is not None and f"{whole:.3f}" != f"{tau:.3f}":
    head += f"; {whole:.3f} counting rounds the budget or a stop cut as whole"
  head += ")"
  if tree:
    head += f"  tree {','.join(map(str, tree))}: {s['nodes_per_round']} nodes per round"
  if s.get("interrupted"):
    head += "  (interrupted: the rows as far as they got)"
  return "\n".join([
      head,
      f"  acceptance per {'depth' if tree else 'position'}: {alphas}",
      (f"  accepted path-length histogram (a = 0..m): {s['accepted_length_histogram']}" if tree else
       f"  accepted-length histogram (a = 0..G): {s['accepted_length_histogram']}"),
      *([f"  chosen draft length histogram (G = 0..G_max, 0 = AR step): "
         f"{s['draft_length_histogram']}"] if s.get("draft_length_histogram") else []),
      (f"  TTFT {ms(s['ttft_s'])}  ITL p50 {ms(s['itl_p50_s'])}  p90 {ms(s['itl_p90_s'])}  "
       f"throughput {num(s['tokens_per_s'], '.1f')} tok/s  wall {s['wall_time_s']:.3f} s "
       f"(prefill {ms(s.get('prefill_s'))}, decoding {num(s.get('decode_tokens_per_s'), '.1f')} "
       "tok/s)" if timing else
       f"  timing: {timing_note}"),
  ])


UNCATEGORISED = "(none)"


def group_rows(categories: Sequence[str | None]) -> dict[str, list[int]]:
  """Row indices per category, categories in order of first appearance;
  a row whose category is None or "" goes to ``UNCATEGORISED``.

  Example: ``group_rows(["code", "math", "code", None])`` ==
  ``{"code": [0, 2], "math": [1], "(none)": [3]}``."""
  out: dict[str, list[int]] = {}
  for r, c in enumerate(categories):
    out.setdefault(c or UNCATEGORISED, []).append(r)
  return out


def summarize_by_category(gen, categories: Sequence[str | None],
                          speedups: dict[str, float] | None = None) -> dict[str, dict]:
  """Per category (``group_rows(categories)``): ``{"rows", "num_tokens",
  "target_calls", "mean_accepted_length", "acceptance_rate_per_position",
  "accepted_length_histogram"}`` from ``summarize(gen, rows)``, plus
  ``"speedup"`` (AR / method wall time) where ``speedups`` has it. Raises
  ValueError unless ``categories`` has one entry per row of ``gen``."""
  if len(categories) != len(gen.tokens):
    raise ValueError(f"{len(categories)} categories for {len(gen.tokens)} rows")
  out = {}
  for cat, rows in group_rows(categories).items():
    s = summarize(gen, rows)
    out[cat] = {"rows": len(rows), "num_tokens": s["num_tokens"],
                "target_calls": s["target_calls"],
                "mean_accepted_length": s["mean_accepted_length"],
                "acceptance_rate_per_position": s["acceptance_rate_per_position"],
                "accepted_length_histogram": s["accepted_length_histogram"]}
    if speedups and cat in speedups:
      out[cat]["speedup"] = speedups[cat]
  return out


def format_by_category(per_category: dict[str, dict]) -> str:
  """A table, one line per category: rows, tokens, tau, alpha_k (and the
  speedup where present)."""
  num = lambda x, spec: "n/a" if x is None else format(x, spec)
  width = max([len(c) for c in per_category] + [8])
  lines = ["per category:"]
  for cat, s in per_category.items():
    alphas = " ".join(num(a, ".2f") for a in s["acceptance_rate_per_position"]) or "n/a (AR)"
    line = (f"  {cat:<{width}}  rows {s['rows']:>3}  tokens {s['num_tokens']:>6}  "
            f"tau {num(s['mean_accepted_length'], '.3f')}  alpha {alphas}")
    if "speedup" in s:
      line += f"  speedup {num(s['speedup'], '.2f')}x"
    lines.append(line)
  return "\n".join(lines)
