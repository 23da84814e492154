"""Independent draft models sized against an MTP target (classic
speculative decoding, Leviathan et al. 2023; experiments/compare_drafters.py):
the target's config turned into a plain LM of given depth and width, its
parameter count without allocating it, the param-matched architecture
search and the candidates of the cost-matched one (whose drafting times
``experiments.compare_drafters.calibrate_cost_arch`` measures).
"""

from __future__ import annotations

from flax import nnx

from mtp import config as config_lib
from mtp.model import build_model, count_params


def draft_config(target_cfg: config_lib.Config, num_layers: int, d_model: int,
                 num_steps: int | None = None, data_dir: str | None = None) -> config_lib.Config:
  """The target's config turned into a plain LM (mtp.depth = 0) of
  ``num_layers`` blocks at width ``d_model``: head_dim = min(target head_dim,
  d_model), num_heads = d_model // head_dim, the target's query/KV head ratio
  (num_kv_heads a divisor of num_heads), the target's MLP/width ratio; same
  vocabulary, tie_embeddings, max_seq_len, data, train and checkpoint
  settings (``num_steps`` / ``data_dir`` override those). Raises ConfigError
  for an invalid result (e.g. an odd head_dim)."""
  m = target_cfg.model
  head_dim = min(m.head_dim, d_model)
  heads = max(1, d_model // head_dim)
  kv = max(1, heads // max(1, m.num_heads // m.num_kv_heads))
  while heads % kv:
    kv -= 1
  mlp = max(1, round(d_model * m.mlp_dim / m.d_model))
  sections = {"model": dict(num_layers=num_layers, d_model=d_model, num_heads=heads,
                            num_kv_heads=kv, head_dim=head_dim, mlp_dim=mlp),
              "mtp": dict(depth=0)}
  if num_steps is not None:
    sections["train"] = dict(num_steps=num_steps)
  if data_dir:
    sections["data"] = dict(data_dir=data_dir)
  return target_cfg.replace(**sections)


def param_count(cfg: config_lib.Config) -> dict[str, int]:
  """``count_params`` of the model ``cfg`` describes, without allocating it."""
  return count_params(nnx.eval_shape(lambda: build_model(cfg)))


def param_matched_arch(target_cfg: config_lib.Config, budget: int,
                       tolerance: float = 0.1) -> tuple[tuple[int, int], list]:
  """(num_layers, d_model) of the param-matched draft, over 1..L_target layers
  and widths k * head_dim <= d_model: among the candidates whose total
  parameter count is within ``tolerance`` (relative) of ``budget``, the
  shallowest (fewest sequential blocks per drafted token, the usual shape of
  a draft model), then the closest; without any, the closest overall. Also
  returns the 5 closest candidates as [{num_layers, d_model, params}] for
  the report. configs/tiny.py (budget 460,032): 2 x 128 (427,648, -7 %)
  rather than 4 x 96 (456,288), which would draft at nearly the cost of the
  4 x 128 target itself."""
  m = target_cfg.model
  cands = []
  for layers in range(1, m.num_layers + 1):
    for width in range(m.head_dim, m.d_model + 1, m.head_dim):
      try:
        p = param_count(draft_config(target_cfg, layers, width))["total"]
      except config_lib.ConfigError:
        continue
      cands.append({"num_layers": layers, "d_model": width, "params": p})
  cands.sort(key=lambda c: (abs(c["params"] - budget), c["num_layers"], c["d_model"]))
  within = [c for c in cands if abs(c["params"] - budget) <= tolerance * budget]
  best = min(within, key=lambda c: c["num_layers"]) if within else cands[0]   # stable: closest first
  return (best["num_layers"], best["d_model"]), cands[:5]


def cost_candidates(target_cfg: config_lib.Config) -> list[tuple[int, int]]:
  """One-layer drafts at widths d_model/4, d_model/2, d_model (even, >= 2)."""
  d = target_cfg.model.d_model
  widths = sorted({max(2, (d // f) // 2 * 2) for f in (4, 2, 1)})
  return [(1, w) for w in widths]


def arch_name(layers: int, width: int, steps: int) -> str:
  """Workdir name of a draft run: ``draft_L2_d128_450steps``."""
  return f"draft_L{layers}_d{width}_{steps}steps"
