"""``python -m ndparallel.plan ...`` (same as ``ndparallel plan ...``)."""

import sys

from ndparallel.plan.cli import main

sys.exit(main())
