#!/usr/bin/env python3
"""Tests of check_doc_paths.py: on small documents written here, in a scratch repository, the
checker reports exactly the cited paths that do not exist, by line, and ignores what its rule
says is not a path."""

import contextlib
import io
import os
import sys
import tempfile
import textwrap
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_doc_paths  # noqa: E402


class CodeSpans(unittest.TestCase):
    def test_single_and_double_backtick_spans_are_delimited_as_commonmark_says(self):
        self.assertEqual(check_doc_paths.code_spans("a `x/y.h` b ``c `d` e`` f"),
                         ["x/y.h", "c `d` e"])

    def test_an_unmatched_backtick_run_is_literal(self):
        self.assertEqual(check_doc_paths.code_spans("a ` b ``c`` d"), ["c"])


class IsCitedPath(unittest.TestCase):
    def test_paths_with_a_slash_or_a_source_extension_are_cited(self):
        for text in ["engine/engine.h", "tests/docs/", "README.md", "CMakeLists.txt",
                     "cpu_optim/kernels_impl.inc", "./base/status.h", "/abs/path"]:
            self.assertTrue(check_doc_paths.is_cited_path(text), text)

    def test_names_flags_placeholders_and_format_files_are_not(self):
        for text in ["strata::engine", "--io-block-size", "manifest.json", "master.safetensors",
                     "<save-dir>/step-N", "block{b}.params", "bench_*", "a b/c",
                     "-DSTRATA_CUDA=ON", "Engine::Step", "", "libstrata.so"]:
            self.assertFalse(check_doc_paths.is_cited_path(text), text)


class Check(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory()
        self.root = self._tmp.name
        os.makedirs(os.path.join(self.root, "engine"))
        open(os.path.join(self.root, "engine", "engine.h"), "w").close()
        open(os.path.join(self.root, "README.md"), "w").close()

    def tearDown(self):
        self._tmp.cleanup()

    def write_doc(self, text):
        path = os.path.join(self.root, "doc.md")
        with open(path, "w", encoding="utf-8") as f:
            f.write(textwrap.dedent(text))
        return path

    def run_main(self, doc):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = check_doc_paths.main(["--root", self.root, doc])
        return rc, out.getvalue()

    def test_reports_each_missing_path_with_its_line_and_nothing_else(self):
        doc = self.write_doc("""\
            <!-- rule -->
            The engine is `engine/engine.h` and `engine/` (see `README.md`).
            Gone: `engine/missing.cc` and `nowhere/`; not a dir: `README.md/`.
            Ignored: `strata::engine`, `--nvme-path`, `manifest.json`, `<dir>/step-N`.
            ```
            `fenced/missing.h` is inside a fenced block
            ```
            ~~~~
            `tilde/missing.h`
            ~~~
            still fenced: the closing fence must be at least as long
            ~~~~
            Escapes: `../outside.h`, `/etc/passwd`, `engine/missing.cc`.
            """)
        lines, count = check_doc_paths.check(doc, self.root)
        self.assertEqual(count, 9)
        self.assertEqual([line.split(": ", 1)[0].rsplit(":", 1)[1] + " " +
                          line.split("`")[1] for line in lines],
                         ["3 engine/missing.cc", "3 nowhere/", "3 README.md/",
                          "13 ../outside.h", "13 /etc/passwd", "13 engine/missing.cc"])
        rc, out = self.run_main(doc)
        self.assertEqual(rc, 1)
        self.assertIn("doc.md:3: `engine/missing.cc` does not exist in the repository", out)
        self.assertIn("`README.md/` is not a directory", out)
        self.assertIn("`../outside.h` leaves the repository", out)
        self.assertIn("`/etc/passwd` is absolute", out)

    def test_a_document_whose_paths_all_exist_passes(self):
        doc = self.write_doc("See `engine/engine.h`, `./engine/engine.h` and `engine/`.\n")
        rc, out = self.run_main(doc)
        self.assertEqual(rc, 0, out)
        self.assertIn("all 3 cited paths exist", out)

    def test_a_document_that_cites_no_path_fails(self):
        doc = self.write_doc("Nothing here: `strata::engine`.\n")
        rc, out = self.run_main(doc)
        self.assertEqual(rc, 1)
        self.assertIn("cites no repository path", out)

    def test_removing_a_cited_file_makes_the_check_fail(self):
        doc = self.write_doc("See `engine/engine.h`.\n")
        self.assertEqual(self.run_main(doc)[0], 0)
        os.remove(os.path.join(self.root, "engine", "engine.h"))
        rc, out = self.run_main(doc)
        self.assertEqual(rc, 1)
        self.assertIn("doc.md:1: `engine/engine.h` does not exist", out)

    def test_a_directory_stands_for_each_markdown_file_in_it(self):
        pages = os.path.join(self.root, "pages")
        os.makedirs(os.path.join(pages, "sub"))
        with open(os.path.join(pages, "a.md"), "w", encoding="utf-8") as f:
            f.write("See `engine/engine.h`.\n")
        with open(os.path.join(pages, "b.md"), "w", encoding="utf-8") as f:
            f.write("Gone: `engine/gone.h`.\n")
        with open(os.path.join(pages, "notes.txt"), "w", encoding="utf-8") as f:
            f.write("Not a page: `engine/also_gone.h`.\n")
        with open(os.path.join(pages, "sub", "c.md"), "w", encoding="utf-8") as f:
            f.write("Not directly in it: `engine/also_gone.h`.\n")
        rc, out = self.run_main(pages)
        self.assertEqual(rc, 1)
        self.assertIn("a.md: all 1 cited paths exist", out)
        self.assertIn("b.md:1: `engine/gone.h` does not exist", out)
        self.assertNotIn("also_gone", out)
        os.remove(os.path.join(pages, "b.md"))
        rc, out = self.run_main(pages)
        self.assertEqual(rc, 0, out)

    def test_a_directory_without_pages_or_a_missing_argument_fails(self):
        empty = os.path.join(self.root, "empty")
        os.makedirs(empty)
        rc, out = self.run_main(empty)
        self.assertEqual(rc, 1)
        self.assertIn("a directory with no *.md file", out)
        rc, out = self.run_main(os.path.join(self.root, "nowhere.md"))
        self.assertEqual(rc, 1)
        self.assertIn("no such document or directory", out)


if __name__ == "__main__":
    unittest.main()
