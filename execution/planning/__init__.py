"""The planning wing: the memory model, one measured step shared by the planner, the dry run
and ``--plan_for``, and the device data sheets. It reads the engine (it builds engines to
measure them); the engine never imports it."""
