"""CTest entry of the Python tests: runs the test_*.py modules of this directory
with unittest, or exits with 77 (CTest SKIP_RETURN_CODE) and a reason when torch is
not importable for this interpreter (Debian's python3-torch installs for
/usr/bin/python3 only). Needs STRATA_LIBRARY (set by CTest to the build's
libstrata.so) and python/ on PYTHONPATH. The modules in OWN_ENTRY are CTest entries of their
own (python_hf_families_test, python_hf_new_families_test, python_hf_gemma3_test,
python_hf_gemma2_test, python_jinja_templates_test, python_chat_tokenize_test,
python_quantize_4bit_test, python_bnb_directory_test: they drive the strata binaries, with their
own environment) and are
left out here."""

import os
import sys
import unittest

SKIP = 77
OWN_ENTRY = {"test_hf_families", "test_hf_new_families", "test_hf_gemma3", "test_hf_gemma2",
             "test_jinja_templates", "test_chat_tokenize",
             "test_quantize_4bit", "test_bnb_directory"}  # modules with their own CTest entry

if __name__ == "__main__":
    try:
        import torch  # noqa: F401
    except ImportError as e:
        print(f"SKIPPED: torch is not importable by {sys.executable} ({e}); install "
              "python3-torch (Debian) to run the strata.optim tests")
        sys.exit(SKIP)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    names = sorted(f[:-3] for f in os.listdir(here) if f.startswith("test_") and f.endswith(".py"))
    suite = unittest.defaultTestLoader.loadTestsFromNames(
        [n for n in names if n not in OWN_ENTRY])
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    sys.exit(0 if result.wasSuccessful() else 1)
