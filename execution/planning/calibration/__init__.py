"""The calibration: the device constants the time model prices a plan with, measured on the
machine at hand and fitted into a ``DeviceSpec`` (``calibrate.py``), from the device's rates
(``kernels.py``), each fused attention kernel's time (``attention.py``), the runtime's
(``runtime.py``) and the host's time per phase (``host_phases.py``). ``benchmarks/calibrate.py``
is its command."""
