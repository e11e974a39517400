"""Commands that measure on the machine at hand and print tables, each run as
``python -m benchmarks.NAME`` from the checkout's root (docs/measuring_speed.md)."""
