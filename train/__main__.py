"""python -m train --config configs/tiny.py --workdir runs/tiny [--config.a.b=value ...]

Parses flags and calls ``train.loop.train``. Config overrides follow the Flax
examples (ml_collections config_flags) and are validated against the typed
schema in ``mtp.config`` before anything runs.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, config).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)   # orbax logs every save at INFO
  from mtp.checkpoint import CheckpointError
  from mtp.config import ConfigError, from_dict
  from mtp.data import DataError
  from train.loop import train
  try:
    cfg = from_dict(_CONFIG.value)
    result = train(cfg, _WORKDIR.value)
  except (ConfigError, DataError, CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  ev = result["eval"]
  if ev:
    print(f"step {result['step']}: validation bits/byte {ev['main/bits_per_byte']:.4f}, "
          f"main top-1 {ev['main/accuracy']:.3f}" + "".join(
              f", MTP depth {k} top-1 {ev[f'mtp_{k}/accuracy']:.3f}"
              for k in range(1, cfg.mtp.depth + 1)))
  return 143 if result["interrupted"] else 0


if __name__ == "__main__":
  app.run(main)
