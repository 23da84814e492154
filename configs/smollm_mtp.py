"""Second stage on the imported SmolLM2-135M-Instruct target (issue 22):
attached MTP modules trained on the target's own chat answers with the
backbone frozen.

    python -m train --config configs/smollm_mtp.py:runs/smollm_d1 --workdir runs/smollm_mtp

The part after ``:`` is the workdir made by ``python -m mtp.importers
--mtp_depth D --mtp_init random`` (default ``runs/smollm_d1``); the
model section (architecture, tokenizer, D) is read from its checkpoint, so
it can never disagree with the target. Whatever D (1-3), three draft
offsets are trained: D modules, then module D applied recursively for
3 - D more steps (``make smollm-mtp SMOLLM_DEPTH=2``). ``make smollm-mtp`` runs the whole
recipe (import, self-distilled data, this stage) and resumes it.

Recipe (FastMTP-style): one module (D = 1) applied recursively for two more
steps (``mtp.recursive_steps``: drafts of G = 3 from one module, trained on
its own outputs), pure distillation from the main head (forward KL,
``mtp.distill_weight = 1``) on the target's own ChatML answers
(``scripts.self_distill --chat_prompts``, loss only on answer tokens), the
module heads over the 4,096 most frequent answer ids (``mtp.draft_vocab_size``,
exact verification is unchanged), and the frozen backbone's hidden states
computed once (``train.hidden_cache``), so a step costs the module and two
4k-id heads instead of 30 layers and two 49k-id heads. Rows are packed
first-fit (``data.packing``): with concat-then-split 36 % of the answer
tokens sat in a row piece cut off from their prompt.
"""

from mtp import loading
from mtp.config import to_config_dict

DEFAULT_INIT = "runs/smollm_d1"
DRAFT_POSITIONS = 3          # offsets trained: D modules, then module D reused past D


def get_config(init_from: str | None = None):
  init_from = init_from or DEFAULT_INIT
  cfg, _ = loading.load_config(init_from)   # CheckpointError naming the folder when missing
  c = to_config_dict(cfg)
  c.mtp.loss_weight = 1.0
  c.mtp.distill_weight = 1.0
  c.mtp.distill_divergence = "kl"
  c.mtp.recursive_steps = max(0, DRAFT_POSITIONS - cfg.mtp.depth)   # D = 1: 2, D = 2: 1, D = 3: 0
  c.mtp.draft_vocab_size = 4096
  c.data.name = "smollm_chat"
  c.data.data_dir = "runs/data"
  c.data.packing = "first_fit"        # every answer trained with its prompt (not cut off)
  c.train.init_from = init_from
  c.train.freeze_backbone = True
  c.train.hidden_cache = True
  c.train.num_steps = 400
  c.train.batch_size = 8
  c.train.seq_len = 512
  c.train.learning_rate = 1e-3
  c.train.warmup_steps = 20
  c.train.weight_decay = 0.0
  c.train.log_every = 10
  c.train.eval_every = 100
  c.train.eval_batches = 4
  c.checkpoint.every_steps = 100
  c.checkpoint.keep = 2
  return c
