"""The static shape of a token tree (``TreeSpec``): branching per depth and
the index arrays verification, drafting and the tree attention masks read.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np


MAX_BRANCHING = 64       # children per node, per depth
MAX_NODES = 512          # nodes per tree (the verify block is 1 + N tokens)


@dataclasses.dataclass(frozen=True)
class TreeSpec:
  """A static draft tree, ``branching`` (b_1, .., b_m): the root (x_{n-1})
  has b_1 children, every depth-1 node b_2, and so on; m is the depth. Nodes
  are numbered breadth first (siblings consecutive, in drafting order), node
  i in 0..N-1; verify blocks put the root at index 0 and node i at 1 + i, so
  the internal nodes are the first ``num_internal`` block indices. Hashable
  (static under ``jax.jit``); derived index arrays are numpy."""
  branching: tuple[int, ...]

  def __post_init__(self):
    b = tuple(self.branching)
    if not b or not all(isinstance(x, (int, np.integer)) and x >= 1 for x in b):
      raise ValueError(f"tree branching must be a non-empty tuple of integers >= 1, got {b!r}")
    object.__setattr__(self, "branching", tuple(int(x) for x in b))

  @property
  def depth(self) -> int:
    """m, the number of levels below the root."""
    return len(self.branching)

  @functools.cached_property
  def counts(self) -> tuple[int, ...]:
    """(n_0, n_1, .., n_m): nodes per depth, n_0 = 1 (the root), n_d = n_{d-1} b_d."""
    out = [1]
    for b in self.branching:
      out.append(out[-1] * b)
    return tuple(out)

  @property
  def num_nodes(self) -> int:
    """N = n_1 + .. + n_m (the root excluded): drafted tokens per round."""
    return sum(self.counts[1:])

  @property
  def num_internal(self) -> int:
    """Nodes with children, root included: n_0 + .. + n_{m-1}."""
    return sum(self.counts[:-1])

  @functools.cached_property
  def offsets(self) -> tuple[int, ...]:
    """offsets[d] = first node index of depth d (d = 1..m; offsets[0] = -1
    stands for the root, which is not a node); offsets[m+1] = N."""
    out, acc = [-1], 0
    for c in self.counts[1:]:
      out.append(acc)
      acc += c
    return tuple(out + [acc])

  @functools.cached_property
  def depths(self) -> np.ndarray:
    """[N] int32, depth 1..m of every node."""
    return np.concatenate([np.full(c, d, np.int32) for d, c in enumerate(self.counts) if d])

  @functools.cached_property
  def parents(self) -> np.ndarray:
    """[N] int32, node index of every node's parent, -1 for the root's children."""
    out = [np.full(self.counts[1], -1)]
    for d in range(2, self.depth + 1):
      out.append(self.offsets[d - 1] + np.arange(self.counts[d]) // self.branching[d - 1])
    return np.concatenate(out).astype(np.int32)

  @functools.cached_property
  def ancestors(self) -> np.ndarray:
    """[N, N] bool: ancestors[i, j] iff node j is node i or one of its
    ancestors (the root excluded)."""
    n = self.num_nodes
    out = np.eye(n, dtype=bool)
    for i in range(n):
      j = self.parents[i]
      while j >= 0:
        out[i, j] = True
        j = self.parents[j]
    return out

  @functools.cached_property
  def block_ancestors(self) -> np.ndarray:
    """[N+1, N+1] bool over verify-block indices (root 0, node i at 1+i):
    ancestor-or-self, the root an ancestor of every node (the tree
    attention mask of the verify block)."""
    n = self.num_nodes
    out = np.zeros((n + 1, n + 1), bool)
    out[:, 0] = True
    out[1:, 1:] = self.ancestors
    return out

  def __str__(self):
    return ",".join(map(str, self.branching))


def parse_tree(text, depth: int | None = None) -> TreeSpec:
  """The ``TreeSpec`` of ``--tree`` ("3,2,1", or a tuple of ints).

  Raises ValueError, one line naming the flag and the allowed range, for
  non-integers, a branching outside [1, MAX_BRANCHING], more than MAX_NODES
  nodes, or (``depth`` = the checkpoint's MTP depth D) a tree deeper than D.
  """
  shown = text if isinstance(text, str) else ",".join(map(str, text))
  if isinstance(text, str):
    parts = [x.strip() for x in text.split(",")]
    try:
      branching = tuple(int(x) for x in parts)
    except ValueError:
      raise ValueError(f"--tree={shown!r}: give the branching per depth as comma-separated "
                       "integers, e.g. --tree 3,2,1") from None
  else:
    branching = tuple(text)
    if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in branching):
      raise ValueError(f"--tree={shown!r}: give the branching per depth as integers, e.g. (3, 2, 1)")
  if not branching:
    raise ValueError("--tree is empty: give the branching per depth, e.g. --tree 3,2,1")
  if not all(1 <= b <= MAX_BRANCHING for b in branching):
    raise ValueError(f"--tree={shown!r}: every branching factor must be an integer in "
                     f"[1, {MAX_BRANCHING}]")
  if depth is not None and not 1 <= len(branching) <= depth:
    raise ValueError(f"--tree={shown!r} has depth {len(branching)}, but the checkpoint has "
                     f"D = {depth} MTP module(s): the tree depth must be in [1, {depth}]")
  spec = TreeSpec(branching)
  if spec.num_nodes > MAX_NODES:
    raise ValueError(f"--tree={shown!r} has {spec.num_nodes} nodes; at most {MAX_NODES} "
                     "(the target verifies 1 + N tokens per round)")
  return spec
