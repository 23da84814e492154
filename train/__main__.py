"""python -m train --config configs/tiny.py --workdir runs/tiny [--config.a.b=value ...]

Parses flags and calls ``train.loop.train``. Config overrides follow the Flax
examples (ml_collections config_flags) and are validated against the typed
schema in ``mtp.config`` before anything runs.

Multi-host: start the same command on every host with ``--coordinator_address
HOST:PORT --num_processes N --process_id I`` (or ``--distributed`` to let
JAX detect them on Cloud TPU, Slurm, Open MPI, Kubernetes); see
``mtp.sharding.initialize_distributed`` and docs/scaling.md.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, config).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-host: HOST:PORT of process 0's coordinator service "
    "(default: $JAX_COORDINATOR_ADDRESS or JAX's cluster auto-detection).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() even without the flags above "
    "(JAX auto-detects Cloud TPU, Slurm, Open MPI and Kubernetes jobs).")
flags.mark_flags_as_required(["config", "workdir"])


def check_flags_early() -> None:
  """The config against ``mtp.config``'s schema and the multi-host flags'
  ranges, before jax loads. Raises ConfigError (a ValueError), one line."""
  from mtp.config import ConfigError, from_dict
  from_dict(_CONFIG.value)
  n, i = _NUM_PROCESSES.value, _PROCESS_ID.value
  if n is not None and n < 1:
    raise ConfigError(f"--num_processes={n} must be >= 1")
  if i is not None and not 0 <= i < (n if n is not None else i + 1):
    raise ConfigError(f"--process_id={i} must be in [0, --num_processes={n})")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)   # orbax logs every save at INFO
  from mtp.cli import check_output_path
  check_output_path("workdir", _WORKDIR.value, "dir")
  from mtp.checkpoint import CheckpointError
  from mtp.config import ConfigError, from_dict
  from mtp.data import DataError
  from mtp.sharding import initialize_distributed
  from mtp.tokenizer_files import TokenizerError
  from train.loop import DivergedError, train
  from train.workdir import WorkdirBusyError
  try:
    cfg = from_dict(_CONFIG.value)
    initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                           force=_DISTRIBUTED.value)
    result = train(cfg, _WORKDIR.value)
  except (ConfigError, DataError, CheckpointError, TokenizerError, WorkdirBusyError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except DivergedError as e:
    print(f"error: {e}", file=sys.stderr)
    return 3
  ev = result.eval
  if ev:
    rate = (f"bits/byte {ev['main/bits_per_byte']:.4f}" if "main/bits_per_byte" in ev
            else f"nats/token {ev['main/loss']:.4f}")
    print(f"step {result.step}: validation {rate}, "
          f"main top-1 {ev['main/accuracy']:.3f}" + "".join(
              f", MTP depth {k} top-1 {ev[f'mtp_{k}/accuracy']:.3f}"
              for k in range(1, cfg.mtp.depth + 1)))
  return 128 + result.signal if result.signal else 0


if __name__ == "__main__":
  from mtp.config import ConfigError, check_override_keys, config_file_arg, read_config_file
  try:   # before absl parses flags: it would fail on these with a traceback
    if config_file_arg(sys.argv[1:]) is not None:
      read_config_file(config_file_arg(sys.argv[1:]))
    check_override_keys(sys.argv[1:])
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  from mtp.cli import flags_parser, main_guard
  main_guard(lambda _: app.run(main, flags_parser=flags_parser(check_flags_early)))
