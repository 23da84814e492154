"""Inference: ``python -m decode``. The engine (``decoder.Decoder``, AR and
speculative) is this package's top level; ``auto/`` is
``--num_draft_tokens=auto``; ``cli/`` the CLI's library and reports. The
map of modules is docs/design.md section 2.
"""
