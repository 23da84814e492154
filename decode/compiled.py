"""The jitted programs of a ``Decoder``, shared by every decoder with the
same settings: what a decoder compiles depends only on its ``ProgramSpec``
(model graphs, drafter, G, tree, "auto" schedule, acceptance rule, mesh;
compared by value or identity), and ``programs(spec)`` builds them once per
distinct spec. Parameters are arguments of every program, never constants,
so decoders over different weights share them too. The traced functions are
pure functions of (spec, arguments): nothing reads a ``Decoder`` instance.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from decode import loops
from decode import mesh as decode_mesh
from decode import round as round_lib
from decode import tree as tree_lib
from decode.drafters import Drafter
from decode.sampling import SamplingParams
from decode.auto.schedule import AutoSchedule
from decode.tree_spec import TreeSpec
from decode.state import DecodeState

CACHE_SIZE = 64      # distinct specs kept (each holds its executables per shape)
ALL_ROUNDS = 2**31 - 1   # generate's round_limit: no limit beyond the budget (a Python int:
                         #   weakly typed like the stream's 1, so both share one program)


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
  """Everything the traced decoding functions depend on besides their
  arguments."""
  target_graphdef: nnx.GraphDef
  draft_graphdef: nnx.GraphDef | None   # None unless the method is "draft"
  drafter: Drafter | None               # None for AR
  longest_draft: int                    # G; G_max with "auto"; the depth m with a tree
  tree: TreeSpec | None
  schedule: AutoSchedule | None
  accept_rule: Callable                 # (sp, g) -> the chain's rule: decode.acceptance.chain_rule
                                        #   or a test's
  mesh: jax.sharding.Mesh | None

  def models(self, params, draft_params):
    """(target, draft model or None) merged from (traced) parameters."""
    target = nnx.merge(self.target_graphdef, params)
    if self.draft_graphdef is None:
      return target, None
    return target, nnx.merge(self.draft_graphdef, draft_params)

  def prefill(self, params, draft_params, state: DecodeState, p: int) -> DecodeState:
    """Target (and drafter) over positions 0..p-1 (static): ``loops.prefill``."""
    return loops.prefill(self.drafter, *self.models(params, draft_params), state, p)

  def round_at(self, params, draft_params, sp: SamplingParams) -> Callable[[int], loops.Round]:
    """g -> the round at static draft length g (0 = AR step; a tree ignores
    g) as ``state -> state``: a partial of ``round.chain_round`` or
    ``tree.tree_round`` itself, so a loop's body is the round."""
    target, draft = self.models(params, draft_params)
    if self.tree is not None:
      return lambda g: functools.partial(tree_lib.tree_round, self.drafter, target, params=sp)
    return lambda g: functools.partial(round_lib.chain_round, self.drafter, target, draft,
                                       params=sp, g=g, schedule=self.schedule,
                                       accept_rule=self.accept_rule)

  def round(self, params, draft_params, sp: SamplingParams, state: DecodeState,
            g: int | None = None) -> DecodeState:
    """One round for every row at static draft length g (default G)."""
    return self.round_at(params, draft_params, sp)(self.longest_draft if g is None else g)(state)


@dataclasses.dataclass(frozen=True)
class Programs:
  """The jitted functions of one ``ProgramSpec`` (signatures as the spec's
  methods; ``generate(params, draft_params, sp, round_limit, state)`` is
  ``loops.generate_loop``, the program of both decoding forms; ``round`` is
  there to inspect one round's program; ``stop_rows(state, lengths [B], mask
  [B])`` cuts rows; the decode state is donated everywhere)."""
  prefill: Callable
  round: Callable
  generate: Callable
  stop_rows: Callable

  def stop_rows_host(self, state: DecodeState, lengths, mask) -> DecodeState:
    """``stop_rows`` with host (numpy) lengths [B] and mask [B] (the stream loop's)."""
    return self.stop_rows(state, jnp.asarray(lengths), jnp.asarray(mask))


def _stop_rows(state: DecodeState, lengths, mask) -> DecodeState:
  return state.replace(length=jnp.where(mask, lengths, state.length), done=state.done | mask)


def _build(spec: ProgramSpec) -> Programs:
  wrap = ((lambda f: f) if spec.mesh is None
          else (lambda f: decode_mesh.constrain_state(f, spec.mesh)))
  return Programs(
      prefill=jax.jit(wrap(spec.prefill), donate_argnums=(2,), static_argnums=(3,)),
      round=jax.jit(wrap(spec.round), donate_argnums=(3,), static_argnums=(4,)),
      generate=jax.jit(wrap(functools.partial(loops.generate_loop, spec)), donate_argnums=(4,)),
      stop_rows=jax.jit(wrap(_stop_rows), donate_argnums=(0,)))


def on_device(tree):
  """``tree`` with its numpy leaves moved to the default device (jax arrays
  stay where they are), so programs do not copy them on every call."""
  return jax.tree.map(lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, tree)


def place_params(mesh, params, draft_params, cfg, draft_cfg=None):
  """(params, draft_params) where the programs take them: on the default
  device without a mesh (``on_device``), else sharded as in training
  (``decode.mesh.place_params``; draft_params None stays None)."""
  if mesh is None:
    return on_device((params, draft_params))
  params = decode_mesh.place_params(mesh, params, cfg)
  if draft_params is not None:
    draft_params = decode_mesh.place_params(mesh, draft_params, draft_cfg)
  return params, draft_params


_cached_build = functools.lru_cache(maxsize=CACHE_SIZE)(_build)


def clear_cache() -> None:
  """Drops every cached ``Programs`` and JAX's compiled executables
  (``jax.clear_caches``), freeing their memory mappings: a long-lived CPU
  process must stay under ``vm.max_map_count`` (docs/testing.md). The next
  call of a program recompiles it."""
  _cached_build.cache_clear()
  jax.clear_caches()


def programs(spec: ProgramSpec) -> Programs:
  """The jitted functions of ``spec``, built once per distinct spec (an
  LRU cache of ``CACHE_SIZE`` specs); a spec holding something unhashable
  (a custom drafter defining ``__eq__`` only) gets programs of its own."""
  try:
    hash(spec)
  except TypeError:
    return _build(spec)
  return _cached_build(spec)
