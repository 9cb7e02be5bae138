"""How the strata package finds libstrata.so: STRATA_LIBRARY, else beside the
package, else the system library path; library_path() names the file loaded.
Each case runs in a fresh interpreter (the library is loaded once per process)."""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import strata

PACKAGE_DIR = os.path.dirname(os.path.abspath(strata.__file__))
BUILT = os.path.realpath(os.environ["STRATA_LIBRARY"])


def run_python(code, env_updates, pythonpath):
    env = {k: v for k, v in os.environ.items()
           if k not in ("STRATA_LIBRARY", "LD_LIBRARY_PATH", "PYTHONPATH")}
    env.update(env_updates)
    env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


class LibraryLookupTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="strata_lookup_")
        # A copy of the package without any library beside it.
        shutil.copytree(PACKAGE_DIR, os.path.join(self.tmp, "pkg", "strata"),
                        ignore=shutil.ignore_patterns("__pycache__", "libstrata.so*"))
        self.pythonpath = os.path.join(self.tmp, "pkg")

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def test_library_path_reports_the_strata_library_file(self):
        self.assertEqual(strata.library_path(), BUILT)
        self.assertEqual(strata.library_version(), strata.__version__)
        self.assertIn(strata.kernel_name(), ("avx512", "avx2", "generic"))

    def test_env_variable_wins_and_a_bad_one_is_an_error_naming_it(self):
        out = run_python("import strata; strata.library_path()",
                         {"STRATA_LIBRARY": os.path.join(self.tmp, "missing.so")},
                         self.pythonpath)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("STRATA_LIBRARY", out.stderr)
        self.assertIn("missing.so", out.stderr)

    def test_library_beside_the_package_is_found(self):
        beside = os.path.join(self.pythonpath, "strata", "libstrata.so.0")
        shutil.copy(BUILT, beside)
        out = run_python("import strata; print(strata.library_path())", {}, self.pythonpath)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), os.path.realpath(beside))

    def test_system_library_path_is_the_last_resort(self):
        libdir = os.path.join(self.tmp, "lib")
        os.makedirs(libdir)
        shutil.copy(BUILT, os.path.join(libdir, "libstrata.so.0"))
        out = run_python("import strata; print(strata.library_path())",
                         {"LD_LIBRARY_PATH": libdir}, self.pythonpath)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), os.path.join(os.path.realpath(libdir),
                                                          "libstrata.so.0"))

    def test_import_strata_works_without_loading_torch(self):
        out = run_python("import sys, strata; strata.library_version(); "
                         "print('torch' in sys.modules)", {"STRATA_LIBRARY": BUILT},
                         self.pythonpath)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "False")


if __name__ == "__main__":
    unittest.main()
