"""The engine wing: one rank's buffers, the moves between them and the compute device, the
phase schedule and bodies, and the optimizer. It runs by a plan it is given
(:class:`~execution.engine.plan.MemoryPlan`) and knows nothing of how the plan was chosen."""
