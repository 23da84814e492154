"""Where a workdir keeps its tokenizer, and the tokenizer error: shared by
``mtp.tokenizer`` (the interface, the byte tokenizer, save/load) and
``mtp.bpe`` (the BPE tokenizer) without either importing the other at
module level."""

TOKENIZER_DIR = "tokenizer"          # WORKDIR/tokenizer/
META_FILE = "tokenizer_meta.json"    # kind, special ids, stop ids, chat template
HF_TOKENIZER_FILE = "tokenizer.json"  # the `tokenizers` model (kind "bpe")


class TokenizerError(ValueError):
  """A missing, unreadable or inconsistent tokenizer (the message names the file)."""
