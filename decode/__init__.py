"""Inference: ``python -m decode`` (docs/design.md section 2 has the map).

The engine is this package's top level: ``decoder`` (the ``Decoder``, AR
and speculative), ``compiled`` (its jitted programs), ``round`` (one
draft-verify-accept-commit round), ``acceptance`` (the acceptance rules,
``rejection_sample``), ``drafters`` (the draft loops), ``kv_cache``,
``sampling``, ``state``, ``loops``, ``tree``; ``auto/`` is
``--num_draft_tokens=auto`` (schedule and calibration); ``cli/`` is the
CLI's library and its reports (``run(DecodeRequest) -> DecodeReport``).
"""
