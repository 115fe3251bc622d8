"""hakmem's Python side: the telemetry ring (ring.py), its layout (layout.py)
and the `hakmem` command (cli/)."""

from ._layout import VERSION as __version__   # one definition: schemas/shm_layout.json
