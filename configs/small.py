"""Small config: a larger model for a fast CPU host or one GPU."""

from mtp.config import Config, ModelConfig, MTPConfig, TrainConfig, CheckpointConfig, to_config_dict


def get_config():
  return to_config_dict(Config(
      model=ModelConfig(vocab_size=264, d_model=384, num_layers=8, num_heads=6, num_kv_heads=2,
                        head_dim=64, mlp_dim=1024, max_seq_len=2048),
      mtp=MTPConfig(depth=2, loss_weight=0.3),
      train=TrainConfig(num_steps=20000, batch_size=64, seq_len=512, learning_rate=1e-3,
                        warmup_steps=1000, log_every=50, eval_every=1000, eval_batches=16),
      checkpoint=CheckpointConfig(every_steps=1000, keep=3),
  ))
