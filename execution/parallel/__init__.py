"""The parallel wing: the process mesh, its groups and collectives, and how every tensor splits
over it. A new parallelism axis (pipeline, context) joins here first: its coordinates and groups
in :mod:`~execution.parallel.mesh`, its split rules in :mod:`~execution.parallel.sharding`."""
