"""Tiny config: trains on 2 CPU cores in about 5 minutes on python_stdlib."""

from mtp.config import Config, ModelConfig, MTPConfig, TrainConfig, CheckpointConfig, to_config_dict


def get_config():
  return to_config_dict(Config(
      model=ModelConfig(vocab_size=264, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
                        head_dim=32, mlp_dim=384, max_seq_len=1024),
      mtp=MTPConfig(depth=2, loss_weight=0.3),
      train=TrainConfig(num_steps=450, batch_size=16, seq_len=128, learning_rate=3e-3,
                        warmup_steps=50, log_every=25, eval_every=150, eval_batches=16),
      checkpoint=CheckpointConfig(every_steps=150, keep=3),
  ))
