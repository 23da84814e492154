"""Kernels launched per decode step, read from a compiled HLO module's text.

    from scripts.hlo_kernels import kernels_per_step
    prefill, generate = decoder.lowered(state, prefill_len, sp)
    kernels_per_step(generate.compile().as_text())
    # {"kernels": 161, "nested_whiles": 2, "conditionals": 0, "by_opcode": {"fusion": 120, ...}, ...}

A decoder's generate program (``decode.decoder.Decoder.lowered``) is
one ``while`` over rounds in the ENTRY computation; one iteration of its
body is one decode step (an AR step or an MTP round). On a GPU every
top-level instruction of that body that is not free (``FREE``: parameter,
constant, get-tuple-element, tuple, bitcast, ...) is one kernel launch: a
``fusion`` (whatever it calls is inside that one kernel), a ``custom-call``
(cuBLAS, cuDNN), an unfused ``dot``, ``copy``, ``all-reduce``, ... A
``call`` is followed into its computation (its instructions run at this
level; XLA:GPU outlines command buffers, CUDA graphs, as calls); a
``while`` or ``conditional`` is control flow: counted apart
(``nested_whiles``, ``conditionals``), its kernels apart too
(``nested_kernels``, once per loop iteration or branch, not multiplied by a
trip count the text does not know). Each nested ``while`` costs a GPU a
host round trip per iteration to read its predicate unless XLA knows its
trip count (``nested_whiles_known_trip_count``). On the CPU a fusion is a
loop inside one compiled program, not a launch: there the count is a proxy
for the same structure.

Pure text processing (no JAX): ``parse_hlo`` splits a module into
computations of instructions, ``kernels_per_step`` counts.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

# Instructions that launch nothing: aliases, tuples, constants baked into the program, and
# the done / update halves of async pairs (their start is the launch).
FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "add-dependency", "opt-barrier", "domain", "get-dimension-size",
})

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->\s*.*?)?\s*\{\s*$")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_COMMENT = re.compile(r"/\*.*?\*/")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-_]*)\s*\(")
_ONE_REF = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_REF_LIST = re.compile(r"\b(branch_computations|calls)=\{([^{}]*)\}")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


@dataclasses.dataclass
class Instruction:
  name: str
  opcode: str
  calls: dict          # attribute -> [computation names] (body, condition, calls, to_apply, ...)
  target: str | None = None            # a custom-call's target
  known_trip_count: int | None = None  # a while's, when XLA annotated it


@dataclasses.dataclass
class Module:
  computations: dict   # name -> [Instruction], in text order
  entry: str | None


def _skip_type(rest: str) -> str:
  """``rest`` after an instruction's result type: a tuple type's balanced
  parentheses, or one token (``f32[2,3]{1,0}``, ``s32[1]{0:T(128)}``)."""
  rest = rest.lstrip()
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return rest[i + 1:]
    return ""
  depth = 0
  for i, ch in enumerate(rest):       # a token; a layout may hold parentheses, never spaces
    if ch in "({[":
      depth += 1
    elif ch in ")}]":
      depth -= 1
    elif ch.isspace() and depth == 0:
      return rest[i:]
  return ""


def parse_instruction(line: str) -> Instruction | None:
  """One instruction line (``%x = type opcode(operands), attr=...``), or
  None when the line is not one."""
  m = _INSTRUCTION.match(line)
  if not m:
    return None
  name, rest = m.groups()
  target = _TARGET.search(rest)
  trip = _TRIP.search(rest)
  rest = _COMMENT.sub("", _STRING.sub('""', rest))
  op = _OPCODE.match(_skip_type(rest))
  if not op:
    return None
  calls: dict[str, list[str]] = {}
  for key, names in _REF_LIST.findall(rest):
    calls.setdefault(key, []).extend(n.strip().lstrip("%") for n in names.split(",") if n.strip())
  for key, ref in _ONE_REF.findall(rest):
    calls.setdefault(key, []).append(ref)
  return Instruction(name, op.group(1), calls, target.group(1) if target else None,
                     int(trip.group(1)) if trip else None)


def parse_hlo(text: str) -> Module:
  """The computations of an HLO module's text: headers ``%name (...) ->
  ... {`` or ``name {`` (``ENTRY`` first marks the entry), instruction lines,
  a closing ``}``. Lines outside a computation (``HloModule``, the stack
  frame tables) are ignored."""
  computations: dict[str, list[Instruction]] = {}
  entry, current = None, None
  for line in text.splitlines():
    stripped = line.strip()
    if current is None:
      if stripped.startswith("HloModule"):
        continue
      m = _HEADER.match(line)
      if m and not _INSTRUCTION.match(line.split("(", 1)[0]):
        current = m.group(2)
        computations[current] = []
        if m.group(1):
          entry = current
      continue
    if stripped == "}":
      current = None
      continue
    inst = parse_instruction(line)
    if inst is not None:
      computations[current].append(inst)
  return Module(computations, entry)


def _refs(inst: Instruction, *keys: str) -> list[str]:
  return [n for k in keys for n in inst.calls.get(k, [])]


def _outer_while(module: Module, comp: str, seen: set) -> Instruction | None:
  """The first ``while`` at the top level of ``comp`` or of a computation
  it ``call``s (an outlined ENTRY)."""
  if comp in seen:
    return None
  seen.add(comp)
  for inst in module.computations.get(comp, []):
    if inst.opcode == "while":
      return inst
    if inst.opcode == "call":
      for callee in _refs(inst, "to_apply", "calls"):
        found = _outer_while(module, callee, seen)
        if found is not None:
          return found
  return None


@dataclasses.dataclass
class _Count:
  kernels: int = 0
  nested_kernels: int = 0
  nested_whiles: int = 0
  known_trip: int = 0
  conditionals: int = 0
  command_buffers: int = 0
  by_opcode: Counter = dataclasses.field(default_factory=Counter)
  custom_calls: Counter = dataclasses.field(default_factory=Counter)


def _walk(module: Module, comp: str, count: _Count, nested: bool, stack: tuple) -> None:
  """Adds ``comp``'s instructions to ``count``: kernels at this level (or
  nested ones), control flow followed (calls at this level, loop bodies,
  conditions and branches as nested)."""
  if comp in stack:                 # a malformed (recursive) module: count it once
    return
  stack = stack + (comp,)
  for inst in module.computations.get(comp, []):
    op = inst.opcode
    if op == "while":
      count.nested_whiles += 1
      count.known_trip += inst.known_trip_count is not None
      for callee in _refs(inst, "condition", "body"):
        _walk(module, callee, count, True, stack)
    elif op == "conditional":
      count.conditionals += 1
      for callee in _refs(inst, "branch_computations", "true_computation", "false_computation"):
        _walk(module, callee, count, True, stack)
    elif op == "call":
      callees = _refs(inst, "to_apply", "calls")
      count.command_buffers += sum(c.startswith("command_buffer") for c in callees)
      for callee in callees:
        _walk(module, callee, count, nested, stack)
    elif op in FREE or op.endswith("-done") or op.endswith("-update"):
      continue
    elif nested:
      count.nested_kernels += 1
    else:
      count.kernels += 1
      count.by_opcode[op] += 1
      if op == "custom-call" and inst.target:
        count.custom_calls[inst.target] += 1


def kernels_per_step(compiled_hlo_text: str) -> dict:
  """Kernel launches of one step of a decode program, from its compiled
  HLO text (``jax.jit(f).lower(...).compile().as_text()``).

  The step is the body of the ENTRY computation's outermost ``while`` (the
  loop over rounds of a generate program); a program without one (a single
  round) is counted whole, its ENTRY as the step.

  Returns {"kernels": top-level kernel-launching instructions of the step
  (``FREE`` ones and control flow left out, ``call``s followed),
  "nested_whiles": ``while`` instructions inside the step, at any depth,
  "nested_whiles_known_trip_count": those of them XLA knows the trip count
  of, "conditionals": ``conditional`` instructions inside it, at any depth,
  "nested_kernels": kernels inside those loops' bodies and conditions and
  the conditionals' branches (each counted once), "condition_kernels":
  kernels of the outer loop's condition (once per step), "command_buffers":
  calls of XLA:GPU's outlined command buffers, "by_opcode": {opcode: n} of
  "kernels", "custom_calls": {target: n} of its custom-calls, "scope": the
  computation counted}.

  Raises ValueError when the text holds no ENTRY computation."""
  module = parse_hlo(compiled_hlo_text)
  if module.entry is None:
    raise ValueError("no ENTRY computation in this HLO text (pass compile().as_text())")
  loop = _outer_while(module, module.entry, set())
  count, cond = _Count(), _Count()
  if loop is None:
    scope = module.entry
    _walk(module, scope, count, False, ())
  else:
    body = _refs(loop, "body")
    if not body:
      raise ValueError(f"the while {loop.name!r} names no body computation")
    scope = body[0]
    _walk(module, scope, count, False, ())
    for c in _refs(loop, "condition"):
      _walk(module, c, cond, False, ())
  return {"kernels": count.kernels, "nested_whiles": count.nested_whiles,
          "nested_whiles_known_trip_count": count.known_trip,
          "conditionals": count.conditionals, "nested_kernels": count.nested_kernels,
          "condition_kernels": cond.kernels + cond.nested_kernels,
          "command_buffers": count.command_buffers,
          "by_opcode": dict(sorted(count.by_opcode.items())),
          "custom_calls": dict(sorted(count.custom_calls.items())), "scope": scope}


def summary(counts: dict) -> str:
  """One cell of a table: "161 (2 loops)", "95", "95 (1 cond)"."""
  extra = []
  if counts.get("nested_whiles"):
    extra.append(f"{counts['nested_whiles']} loop{'s' if counts['nested_whiles'] > 1 else ''}")
  if counts.get("conditionals"):
    extra.append(f"{counts['conditionals']} cond")
  return f"{counts['kernels']}" + (f" ({', '.join(extra)})" if extra else "")
