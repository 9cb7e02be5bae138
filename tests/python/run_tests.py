"""CTest entry of the Python tests: runs `python -m unittest discover` over this
directory, or exits with 77 (CTest SKIP_RETURN_CODE) and a reason when torch is
not importable for this interpreter (Debian's python3-torch installs for
/usr/bin/python3 only). Needs STRATA_LIBRARY (set by CTest to the build's
libstrata.so) and python/ on PYTHONPATH."""

import os
import sys
import unittest

SKIP = 77

if __name__ == "__main__":
    try:
        import torch  # noqa: F401
    except ImportError as e:
        print(f"SKIPPED: torch is not importable by {sys.executable} ({e}); install "
              "python3-torch (Debian) to run the strata.optim tests")
        sys.exit(SKIP)
    here = os.path.dirname(os.path.abspath(__file__))
    suite = unittest.defaultTestLoader.discover(here, pattern="test_*.py", top_level_dir=here)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    sys.exit(0 if result.wasSuccessful() else 1)
