"""Test-only draft-length schedules (past-only, for losslessness tests)."""

import dataclasses

import jax.numpy as jnp

from decode.auto.schedule import AutoSchedule


@dataclasses.dataclass(frozen=True)
class CyclingSchedule(AutoSchedule):
  """Test schedule: g = (round + offset) mod (G_max + 1), one round per
  segment, switching every round whatever happens (a past-only schedule,
  for losslessness tests).
  The offset enters through the state's round counter, so decoders compiled
  with one offset serve every offset."""
  offset: int = 0

  def init_state(self, batch: int, costs) -> dict:
    return {**super().init_state(batch, costs), "round": jnp.int32(self.offset)}

  def choose(self, sched, active):
    g = (sched["round"] % (self.max_draft_tokens + 1)).astype(jnp.int32)
    g = jnp.where(sched["force"] >= 0, sched["force"], g)
    return g, jnp.int32(1), {**sched, "round": sched["round"] + 1}
