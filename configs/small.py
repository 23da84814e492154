"""Small config (~16M parameters with D = 2): for one GPU or a large CPU host.

Batch 16 x 512 keeps the attention activations of a training step under
~8 GB; raise train.batch_size on a bigger accelerator.
"""

from mtp.config import Config, ModelConfig, MTPConfig, TrainConfig, CheckpointConfig, to_config_dict


def get_config():
  return to_config_dict(Config(
      model=ModelConfig(vocab_size=264, d_model=384, num_layers=8, num_heads=6, num_kv_heads=2,
                        head_dim=64, mlp_dim=1024, max_seq_len=2048),
      mtp=MTPConfig(depth=2, loss_weight=0.3),
      train=TrainConfig(num_steps=20000, batch_size=16, seq_len=512, learning_rate=1e-3,
                        warmup_steps=1000, log_every=50, eval_every=1000, eval_batches=16),
      checkpoint=CheckpointConfig(every_steps=1000, keep=3),
  ))
