"""eagle3lib: the library behind the EAGLE-3 workbook notebooks."""

import os

# torch's default OpenMP spinning is 5-19x slower on a loaded 2-core machine
# (docs/design.md §3); it must be set before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
