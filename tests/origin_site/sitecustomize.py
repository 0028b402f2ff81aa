"""Child interpreters started inside ``tests/output_origin.py``'s ``recorded_output`` (a rank, the
simulated rank) note the lines ndparallel writes too; elsewhere this does nothing."""

import os
import sys

if os.environ.get("NDPARALLEL_TEST_OWN_LINES"):
    _tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, _tests)
    try:
        from output_origin import note_own_lines

        note_own_lines(os.environ["NDPARALLEL_TEST_OWN_LINES"])
    finally:
        sys.path.remove(_tests)
