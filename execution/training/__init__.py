"""The training wing: assembling a run from its config (:mod:`~execution.training.build`) and
the loop that steps it (:mod:`~execution.training.loop`). It sits on top of every other wing."""
