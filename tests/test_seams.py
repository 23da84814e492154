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


def test_decode_request_and_report_are_typed_and_the_json_keeps_its_layout():
  from decode.cli.run import DecodeReport, DecodeRequest
  hints = typing.get_type_hints(DecodeRequest)
  assert set(hints) == {f.name for f in dataclasses.fields(DecodeRequest)}
  assert DecodeRequest.__dataclass_params__.frozen
  req = DecodeRequest("w", ["a"])
  assert (req.method, req.num_draft_tokens, req.max_new_tokens) == ("mtp", 2, 128)
  # keys in today's order: config, results, stats, [interrupted], the comparison's, per_category
  rep = DecodeReport({"method": "mtp"}, [], {}, comparison={"ar_stats": {}, "speedup": 1.5},
                     per_category={"c": {}})
  assert list(rep.to_json()) == ["config", "results", "stats", "ar_stats", "speedup",
                                 "per_category"]
  rep = DecodeReport({}, [], {}, interrupted=True, decoding_interrupted=True)
  assert list(rep.to_json()) == ["config", "results", "stats", "interrupted"]
  rep = DecodeReport({}, [], {}, interrupted=True, comparison={"speedup": 1.0})
  assert list(rep.to_json()) == ["config", "results", "stats", "speedup", "interrupted"]


def test_method_names_the_draft_length_and_the_tree_depth_apart():
  from decode import decoder
  chain = decoder.Method(3)
  assert (chain.num_draft_tokens, chain.tree_depth, chain.longest_draft) == (3, 0, 3)
  spec = tree.parse_tree("2,1", 2)
  t = decoder.Method(0, tree.TreeMTPDrafter(spec, 2), tree=spec, tree_depth=spec.depth)
  assert (t.num_draft_tokens, t.tree_depth, t.longest_draft) == (0, 2, 2)
