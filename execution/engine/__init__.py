"""The engine wing: one rank's training step, run by a plan it is given
(:class:`~execution.engine.plan.EnginePlan`), knowing nothing of how the plan was chosen.

Three floors, each importing only those below it:

- ``phases/``: the step, the phase schedule and bodies, the pipeline's moves, gradient
  reduction and what a layer keeps for its backward; the driver ``engine.py`` sits above;
- ``update/``: AdamW and its driver, RigL's connectivity updates;
- ``storage/``: where state lives (buffers, host memory, the state store, gradient store,
  masks) and how it moves (loads, stores, side streams).
"""
