"""hakmem's Python side: the telemetry ring (ring.py), its layout (layout.py)
and the `hakmem` command (cli.py)."""

__version__ = "0.2.0"
