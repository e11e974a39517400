"""The update after a step's gradients are complete: AdamW on every shard and its driver,
RigL's connectivity updates. It reads storage, never the phases."""
