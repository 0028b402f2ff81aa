"""``python -m ndparallel.plan ...`` (same as ``ndparallel plan ...``)."""

import sys

from ndparallel.plan.cli.main import main

sys.exit(main())
