"""One step's phases: their schedule, the step's state, the context the bodies see, the
bodies and heads, the pipeline's point-to-point moves, gradient accumulation and reduction,
and what a layer keeps for its backward. It reads storage, never the update."""
