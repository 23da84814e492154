"""Reference target for speculative decoding: 16 layers, D = 3 MTP modules.

Why this shape (docs/results.md, "The reference model"):

- Depth 16 makes one MTP module (one transformer block plus the shared head)
  a small share of a target step: by FLOPs about 1/16 per draft token, so
  drafting G = 3 tokens costs ~0.2 of a target step, where the 4-layer demo
  model pays ~0.5 per token and cannot win.
- Width 128 (4 query / 2 KV heads of 32, SwiGLU 384) keeps training on 2
  CPU cores to hours, not days: 2 h 45 min on a shared machine
  (results/train_reference.md).
- seq_len 512 covers the positions a decode of a 256-byte prompt plus a few
  hundred new tokens reaches, so decoding never runs on RoPE positions the
  model was not trained on.
- D = 3 modules with lambda = 0.5 (DeepSeek-V3 eq. 25): the ablation in
  docs/results.md shows the main head gaining at lambda 0.3-1.0 and
  acceptance rising with lambda; chains of G = 1..3 use trained modules.

Train (resumes when interrupted): ``make reference``.
"""

from mtp.config import CheckpointConfig, Config, ModelConfig, MTPConfig, TrainConfig, to_config_dict


def get_config():
  return to_config_dict(Config(
      model=ModelConfig(vocab_size=264, d_model=128, num_layers=16, num_heads=4, num_kv_heads=2,
                        head_dim=32, mlp_dim=384, max_seq_len=1024),
      mtp=MTPConfig(depth=3, loss_weight=0.5),
      train=TrainConfig(num_steps=1200, batch_size=8, seq_len=512, learning_rate=2e-3,
                        warmup_steps=100, log_every=10, eval_every=200, eval_batches=8),
      checkpoint=CheckpointConfig(every_steps=100, keep=2),
  ))
