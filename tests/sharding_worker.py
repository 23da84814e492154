"""Subprocess worker for tests/test_sharding.py (JAX must see fake CPU devices
before it loads, which the pytest process cannot change any more).

    python tests/sharding_worker.py meshes  --depth D --workdir DIR --out OUT.json
    python tests/sharding_worker.py process --process_id I --port P --workdir DIR --out OUT.json
    python tests/sharding_worker.py distill --workdir DIR --out OUT.json

``meshes`` (8 fake devices): N training steps of the same config and batches
on meshes 8x1x1, 1x8x1, 2x2x2 and one device; the layout of a few arrays;
per-device parameter bytes; the bad-input errors; with ``--extras`` also
save on 8x1x1 / restore on 2x2x2 and one device, and sharded decoding at
temperature 0 against one device.

``process`` (2 fake devices per process, 2 processes on loopback): the same
training on a 1x2x2 mesh spanning both processes (FSDP across them, tensor
parallel within), each process feeding only its half of the batch; then a
checkpoint with a per-process grain iterator state, restored.

``distill`` (8 fake devices, tests/test_distill.py): a frozen-backbone
distillation stage with a recursive step (train.freeze_backbone,
mtp.distill_weight, mtp.recursive_steps) on a 2x2x2 mesh and on one device
from the same parameters: losses, whether the frozen parameters stayed
bitwise equal, and the largest difference of the trained ones.

Results go to OUT.json; the tests compare them.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys

DEVICES = {"meshes": 8, "process": 2, "distill": 8}
NUM_STEPS = 3
DECODE_STEPS = 150   # extra one-device steps for a decoding model that accepts some drafts
BATCH = 8
SEQ = 32


def _setup_env(mode: str):
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={DEVICES[mode]}")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(depth: int):
  from tests.conftest import tiny_config
  # One backbone layer (the MTP modules add D more blocks): compile time
  # dominates these tests and the layout rules are the same for every layer.
  return tiny_config(model=dict(num_layers=1), mtp=dict(depth=depth),
                     train=dict(batch_size=BATCH, seq_len=SEQ, warmup_steps=0, num_steps=10))


def _batches(n: int):
  import numpy as np
  from tests.conftest import markov_batch, markov_transition
  rng = np.random.default_rng(0)
  transition = markov_transition()
  return [markov_batch(rng, BATCH, SEQ, transition) for _ in range(n)]


def _host(tree):
  import jax
  import numpy as np
  return jax.tree.map(np.asarray, jax.device_get(tree))


def _max_diff(a, b) -> float:
  import jax
  import numpy as np
  return float(max(np.max(np.abs(x - y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


def _layout(x) -> dict:
  """Spec and first addressable shard shape of an array."""
  return {"spec": [a if a is None or isinstance(a, str) else list(a) for a in x.sharding.spec],
          "shard_shape": list(x.addressable_shards[0].data.shape), "shape": list(x.shape)}


def _errors(cfg) -> dict[str, str]:
  """Bad-input cases: every one must raise ConfigError before compiling."""
  import jax
  from mtp import sharding as shard_lib
  from mtp.config import ConfigError, MeshConfig
  from train.loop import Trainer
  cases = {
      "mesh_product": lambda: Trainer(cfg.replace(mesh=dict(data=3, fsdp=1, tensor=1))),
      "mesh_fixed_axes": lambda: Trainer(cfg.replace(mesh=dict(data=-1, fsdp=3, tensor=1))),
      "batch": lambda: Trainer(cfg.replace(train=dict(batch_size=6)),
                               shard_lib.make_mesh(MeshConfig(8, 1, 1))),
      "kv_heads": lambda: Trainer(cfg, shard_lib.make_mesh(MeshConfig(2, 1, 4))),
      "heads": lambda: Trainer(cfg.replace(model=dict(num_kv_heads=4)),
                               shard_lib.make_mesh(MeshConfig(1, 1, 8))),
      "mlp": lambda: Trainer(cfg.replace(model=dict(mlp_dim=66, num_kv_heads=4)),
                             shard_lib.make_mesh(MeshConfig(2, 1, 4))),
      "vocab": lambda: Trainer(cfg.replace(model=dict(vocab_size=265)),
                               shard_lib.make_mesh(MeshConfig(4, 1, 2))),
      "fsdp": lambda: Trainer(cfg.replace(model=dict(d_model=36)),
                              shard_lib.make_mesh(MeshConfig(1, 8, 1))),
  }
  out = {}
  for name, fn in cases.items():
    try:
      fn()
      out[name] = "no error"
    except ConfigError as e:
      out[name] = str(e)
  assert jax.device_count() == 8
  return out


def run_meshes(args) -> dict:
  import jax
  import numpy as np
  from mtp import sharding as shard_lib
  from mtp.config import MeshConfig
  from train.loop import Trainer

  cfg = _config(args.depth)
  batches = _batches(NUM_STEPS + 1)
  out = {"devices": jax.device_count(), "losses": {}, "layout": {}, "bytes_per_device": {},
         "final_params_max_diff": {}}
  shapes = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 1, 1)]
  finals, kept = {}, {}
  for shape in shapes:
    name = "x".join(map(str, shape))
    devices = jax.devices()[:int(np.prod(shape))]
    trainer = Trainer(cfg, shard_lib.make_mesh(MeshConfig(*shape), devices))
    state = trainer.init_state()
    losses = []
    for batch in batches[:NUM_STEPS]:
      state, metrics = trainer.train_step(state, batch)
      losses.append(float(metrics["loss"]))
    out["losses"][name] = losses
    p, mu = state.params, state.opt_state[1][0].mu
    out["layout"][name] = {
        "mlp_gate": _layout(p["blocks"][0]["mlp"]["gate"]["kernel"].get_value()),
        "mlp_down": _layout(p["blocks"][0]["mlp"]["down"]["kernel"].get_value()),
        "q_proj": _layout(p["blocks"][0]["attn"]["q_proj"]["kernel"].get_value()),
        "embed": _layout(p["embed"]["embedding"].get_value()),
        "norm": _layout(p["final_norm"]["scale"].get_value()),
        "mu_mlp_gate": _layout(mu["blocks"][0]["mlp"]["gate"]["kernel"].get_value()),
        "count": _layout(state.opt_state[1][0].count),
    }
    if args.depth:
      out["layout"][name]["mtp_proj"] = _layout(p["mtp"][0]["proj"]["kernel"].get_value())
      out["layout"][name]["mtp_mlp_up"] = _layout(p["mtp"][0]["block"]["mlp"]["up"]["kernel"]
                                                  .get_value())
    out["bytes_per_device"][name] = shard_lib.bytes_per_device(trainer.abstract_params,
                                                               trainer.param_shardings)
    finals[name] = _host(state.params)
    kept[name] = (trainer, state)
  for name in finals:
    out["final_params_max_diff"][name] = _max_diff(finals[name], finals["1x1x1"])
  out["errors"] = _errors(cfg)
  if args.extras:
    out["nonfinite"] = _nonfinite_messages(kept["2x2x2"][0].mesh)
    out.update(_checkpoint_and_decode(args, cfg, batches, kept))
  return out


def _checkpoint_and_decode(args, cfg, batches, kept) -> dict:
  """Save on 8x1x1, restore on 2x2x2 and one device; sharded decoding."""
  import jax
  import numpy as np
  from mtp import checkpoint as ckpt_lib
  from mtp import sharding as shard_lib
  from mtp import tokenizer as tok
  from mtp.config import MeshConfig
  from decode.decoder import Decoder, SamplingParams
  from train.loop import TrainState

  out = {}
  src_trainer, src_state = kept["8x1x1"]
  ckpt = ckpt_lib.Checkpointer(os.path.join(args.workdir, "ckpt"))
  ckpt.save(src_state.step, src_state.params, src_state.opt_state, None, cfg)
  saved = _host({"params": src_state.params, "opt": src_state.opt_state})
  _, metrics = src_trainer.train_step(src_state, batches[NUM_STEPS])   # donates src_state
  out["next_loss"] = {"8x1x1": float(metrics["loss"])}
  out["restored_equal"], out["restored_layout"] = {}, {}
  for name in ("2x2x2", "1x1x1"):
    trainer = kept[name][0]      # same mesh and jitted step as in training (compiled once)
    params, opt = ckpt.restore(NUM_STEPS, trainer.abstract_params, trainer.abstract_opt_state)
    got = _host({"params": params, "opt": opt})
    out["restored_equal"][name] = all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(got)))
    out["restored_layout"][name] = {
        "q_proj": _layout(params["blocks"][0]["attn"]["q_proj"]["kernel"].get_value()),
        "want": [a if a is None or isinstance(a, str) else list(a) for a in
                 trainer.abstract_params["blocks"][0]["attn"]["q_proj"]["kernel"]
                 .get_value().sharding.spec]}
    _, metrics = trainer.train_step(TrainState(params, opt, NUM_STEPS), batches[NUM_STEPS])
    out["next_loss"][name] = float(metrics["loss"])
  ckpt.close()

  # Decoding at temperature 0: the same host parameters on one device and on a
  # 4x1x2 mesh. "trained": the one-device run trained on for DECODE_STEPS
  # more steps, with noise on its MTP modules (rows accept different numbers
  # of drafts; G=3 > D reuses module D); "untied": a random model with an
  # untied head (varied tokens), decoded autoregressively.
  from flax import nnx
  from mtp.model import build_model
  from tests.conftest import markov_batch, markov_transition
  trainer1, state1 = kept["1x1x1"]
  data_rng, transition = np.random.default_rng(2), markov_transition()
  for _ in range(DECODE_STEPS):
    state1, _ = trainer1.train_step(state1, markov_batch(data_rng, BATCH, SEQ, transition))
  rng = np.random.default_rng(1)
  noisy = jax.tree_util.tree_map_with_path(
      lambda path, x: x + (0.3 * x.std() * rng.standard_normal(x.shape).astype(x.dtype)
                           if "mtp" in jax.tree_util.keystr(path) else 0), _host(state1.params))
  untied_cfg = cfg.replace(model=dict(tie_embeddings=False))
  untied = nnx.state(build_model(untied_cfg, seed=1), nnx.Param)
  graphdefs = {"trained": src_trainer.graphdef,
               "untied": nnx.split(nnx.eval_shape(lambda: build_model(untied_cfg)), nnx.Param)[0]}
  models = {name: nnx.merge(graphdefs[name], jax.device_put(_host(p), jax.devices()[0]))
            for name, p in (("trained", noisy), ("untied", untied))}
  texts = ["def f(x):", "ab", "import os\nimport sys", "cdef ab"]
  prompts = [tok.ByteTokenizer().encode(t, add_bos=True) for t in texts]
  greedy = SamplingParams(temperature=0.0)
  mesh = shard_lib.make_mesh(MeshConfig(4, 1, 2))
  out["decode"] = {}
  for name, method, g, stream in (("trained", "mtp", 3, True), ("untied", "ar", 0, False)):
    model = models[name]
    ref = Decoder(model, method, g).generate(prompts, 16, greedy)
    dec = Decoder(model, method, g, mesh=mesh)
    runs = {"sharded": dec.generate(prompts, 16, greedy)}
    if stream:
      runs["sharded_stream"] = dec.stream(prompts, 16, greedy)
    gate = dec.target_params["blocks"][0]["mlp"]["gate"]["kernel"].get_value()
    out["decode"][f"{name}_{method}{g}"] = {
        "ref": [r.tolist() for r in ref.tokens],
        "ref_histogram": ref.accepted_histogram.tolist(),
        **{k: [r.tolist() for r in v.tokens] for k, v in runs.items()},
        **{k + "_histogram": v.accepted_histogram.tolist() for k, v in runs.items()},
        "param": _layout(gate)}
  model = models["trained"]
  try:
    Decoder(model, "mtp", 2, mesh=mesh).generate(prompts[:3], 4, greedy)
    out["decode"]["bad_batch"] = "no error"
  except ValueError as e:
    out["decode"]["bad_batch"] = str(e)
  return out


def _nonfinite_messages(mesh) -> dict:
  """check_finite's error for parameters on ``mesh`` with NaNs in known
  places: "split" (one row per device) is all NaN in process 1's rows with
  two processes, and holds 3 NaNs placed by hand with one; "replicated"
  holds 2 NaNs on every device (counted once, not per copy); "local" is a
  numpy leaf with 1 NaN beside a finite global array (every process holds
  all of it: counted once, not once per process)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  from mtp import checkpoint as ckpt_lib
  n = mesh.devices.size
  host = np.ones((n, 4), np.float32)
  if jax.process_count() == 1:
    host[0, 1] = host[n - 1, 2] = host[n - 1, 3] = np.nan
  rows = NamedSharding(mesh, P(mesh.axis_names, None))
  split = jax.make_array_from_callback(
      host.shape, rows, lambda idx: host[idx] if jax.process_count() == 1 or jax.process_index() == 0
      else np.full_like(host[idx], np.nan))
  rep = np.ones((4, 4), np.float32)
  rep[1, 1] = rep[2, 3] = np.nan
  # not device_put: with several processes it compares the host values across processes, and NaN != NaN
  replicated = jax.make_array_from_callback(rep.shape, NamedSharding(mesh, P()), lambda idx: rep[idx])
  finite = jax.make_array_from_callback((n, 4), rows, lambda idx: np.ones((n, 4), np.float32)[idx])
  local = np.array([1.0, np.nan, 2.0, 3.0], np.float32)
  cases = {"split": {"ok": np.ones(3, np.float32), "split": split},
           "replicated": {"ok": np.ones(3, np.float32), "replicated": replicated},
           "local": {"finite": finite, "local": local}}
  out = {}
  for name, params in cases.items():
    try:
      ckpt_lib.check_finite(params, "CKPT")
      out[name] = "no error"
    except ckpt_lib.CheckpointError as e:
      out[name] = str(e)
  return out


def _mark(phase: str):
  """One progress line in the worker's log (the fixture shows its tail on a
  failure, so a hang names the phase it stopped in)."""
  import time
  print(f"[sharding_worker {time.strftime('%H:%M:%S')}] {phase}", file=sys.stderr, flush=True)


def run_process(args) -> dict:
  from mtp import sharding as shard_lib
  _mark(f"process {args.process_id}: jax.distributed.initialize")
  shard_lib.initialize_distributed(f"127.0.0.1:{args.port}", 2, args.process_id)
  import grain
  import jax
  import numpy as np
  from mtp import checkpoint as ckpt_lib
  from mtp.config import MeshConfig
  from train.loop import Trainer

  cfg = _config(2)
  pid, n = jax.process_index(), jax.process_count()
  mesh = shard_lib.make_mesh(MeshConfig(1, 2, 2))
  trainer = Trainer(cfg, mesh)
  state = trainer.init_state()
  rows = BATCH // n
  losses = []
  for i, batch in enumerate(_batches(NUM_STEPS)):
    _mark(f"train step {i}")
    local = {k: v[pid * rows:(pid + 1) * rows] for k, v in batch.items()}
    state, metrics = trainer.train_step(state, local)
    losses.append(float(metrics["loss"]))
  gate = state.params["blocks"][0]["mlp"]["gate"]["kernel"].get_value()
  out = {"process_index": pid, "process_count": n, "devices": jax.device_count(),
         "local_devices": jax.local_device_count(), "losses": losses, "gate": _layout(gate)}

  # Checkpoint from both processes, with a per-process data iterator state.
  data_iter = iter(grain.MapDataset.range(16)[pid::n].to_iter_dataset())
  for _ in range(pid + 1):
    next(data_iter)
  _mark("checkpoint save")
  ckpt = ckpt_lib.Checkpointer(args.workdir)
  ckpt.save(state.step, state.params, state.opt_state, data_iter, cfg)
  saved = [np.asarray(s.data) for s in gate.addressable_shards]
  fresh = iter(grain.MapDataset.range(16)[pid::n].to_iter_dataset())
  _mark("checkpoint restore")
  params, _ = ckpt.restore(NUM_STEPS, trainer.abstract_params, trainer.abstract_opt_state, fresh)
  got = params["blocks"][0]["mlp"]["gate"]["kernel"].get_value()
  out["restored_equal"] = all(np.array_equal(a, np.asarray(s.data))
                              for a, s in zip(saved, got.addressable_shards))
  out["restored_next_item"] = int(next(fresh))
  out["restored_config_depth"] = ckpt.restore_config(NUM_STEPS).mtp.depth
  ckpt.close()
  _mark("non-finite check")
  out["nonfinite"] = _nonfinite_messages(mesh)
  _mark("done")
  return out


def run_distill(args) -> dict:
  import jax
  import numpy as np
  from flax import nnx
  from mtp import sharding as shard_lib
  from mtp.config import MeshConfig
  from train.loop import MTP_PARAMS, Trainer

  cfg = _config(2).replace(mtp=dict(distill_weight=0.5, distill_temperature=2.0, recursive_steps=1),
                           train=dict(freeze_backbone=True))
  batches = _batches(NUM_STEPS)
  start = _host(Trainer(cfg, shard_lib.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]))
                .init_state().params)
  out = {"devices": jax.device_count(), "losses": {}, "frozen_bitwise": {}}
  finals = {}
  for shape in ((2, 2, 2), (1, 1, 1)):
    name = "x".join(map(str, shape))
    trainer = Trainer(cfg, shard_lib.make_mesh(MeshConfig(*shape), jax.devices()[:int(np.prod(shape))]))
    state = trainer.init_state(jax.device_put(start, trainer.param_shardings))
    losses = []
    for batch in batches:
      state, metrics = trainer.train_step(state, batch)
      losses.append(float(metrics["loss"]))
    out["losses"][name] = losses
    final = _host(state.params)
    frozen_now, frozen_start = (nnx.split_state(t, MTP_PARAMS, ...)[1] for t in (final, start))
    out["frozen_bitwise"][name] = all(np.array_equal(a, b) for a, b in
                                      zip(jax.tree.leaves(frozen_now), jax.tree.leaves(frozen_start)))
    finals[name] = final
  out["trained_max_diff"] = _max_diff(finals["2x2x2"], finals["1x1x1"])
  out["moved"] = _max_diff(finals["1x1x1"], start)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("mode", choices=sorted(DEVICES))
  ap.add_argument("--depth", type=int, default=2)
  ap.add_argument("--extras", action="store_true")
  ap.add_argument("--process_id", type=int, default=0)
  ap.add_argument("--port", type=int, default=0)
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  # SIGUSR1 writes every thread's Python stack to stderr (the log): the
  # fixture sends it to a hung pair before killing it, so the log shows
  # where each process waited.
  faulthandler.register(signal.SIGUSR1, all_threads=True)
  _setup_env(args.mode)
  import time
  t0 = time.time()
  result = {"meshes": run_meshes, "process": run_process, "distill": run_distill}[args.mode](args)
  result["wall_s"] = time.time() - t0
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  if args.mode == "process":
    _mark("result written; exiting (jax.distributed shuts down at exit)")


if __name__ == "__main__":
  main()
