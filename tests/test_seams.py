"""The typed seams (issue 50): every drafter the engine ships implements
the ``Drafter`` protocol, and ``ProgramSpec`` names its field types."""

import dataclasses
import typing

from decode import compiled, drafters, tree


def test_the_shipped_drafters_implement_the_protocol():
  made = [drafters.MTPDrafter(1, 3), drafters.MTPDrafter(2, 3, variable=True),
          drafters.DraftModelDrafter(), tree.TreeMTPDrafter(tree.parse_tree("2,1"), 2)]
  for d in made:
    assert isinstance(d, drafters.Drafter), type(d).__name__
    assert d.min_length in (1, 2)
  assert not isinstance(object(), drafters.Drafter)


def test_program_spec_fields_are_typed():
  hints = typing.get_type_hints(compiled.ProgramSpec)
  for f in dataclasses.fields(compiled.ProgramSpec):
    assert hints[f.name] is not typing.Any, f.name


def test_method_names_its_drafter_and_tree_types():
  from decode import decoder
  hints = typing.get_type_hints(decoder.Method)
  assert "Drafter" in str(hints["drafter"]) and "TreeSpec" in str(hints["tree"])
