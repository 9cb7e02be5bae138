#!/usr/bin/env python3
"""Tests of check_doc_blocks.py: the matching rule on lines, and whole documents written here run
against a stand-in `strata` (a small script with a --help and fixed output), in a scratch
repository: a quoted figure that the binary does not print, a failing command, an unknown flag,
a missing path and an unmarked block each fail the check; a true document passes."""

import contextlib
import io
import os
import stat
import sys
import tempfile
import textwrap
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_doc_blocks  # noqa: E402

FAKE_STRATA = r'''#!/bin/sh
case "$1 $2" in
  "--help "*) printf 'strata\nSUBCOMMANDS:\n  train    Train\n  estimate Estimate\n'; exit 0;;
  "train --help") printf 'OPTIONS:\n  -h,--help   Print\n  --steps INT  Steps\n  --save-dir TEXT  Dir\n  --data TEXT ...  Data\nCheckpoints:\n  --keep-last INT  K\n'; exit 0;;
  "estimate --help") printf 'OPTIONS:\n  -h,--help   Print\n  --model TEXT  Model\n'; exit 0;;
  "train "*) echo "step 1/2 loss 2.5096 | 1234 tokens/s"; echo "validation loss 2.4069 nats/token"; echo "done" >&2; exit 0;;
  "estimate "*) echo "verdict: infeasible"; exit 3;;
esac
exit 2
'''


def matches(quoted, line):
    return check_doc_blocks.matches(quoted, [line])


class Matching(unittest.TestCase):
    def test_a_line_without_ellipsis_is_the_whole_line_up_to_surrounding_space(self):
        self.assertTrue(matches("validation loss 2.4069 nats/token",
                                "  validation loss 2.4069 nats/token  "))
        self.assertFalse(matches("validation loss 2.4069", "validation loss 2.4069 nats/token"))

    def test_numbers_match_to_the_digits_shown_and_no_further(self):
        self.assertTrue(matches("loss 2.5096 ...", "loss 2.5096 nats"))
        self.assertFalse(matches("loss 2.5096...", "loss 2.50963 nats"))
        self.assertFalse(matches("loss 2.509...", "loss 2.5096 nats"))
        self.assertFalse(matches("...96 nats", "loss 2.5096 nats"))
        self.assertTrue(matches("... 2.5096 nats", "loss 2.5096 nats"))

    def test_ellipses_leave_out_text_in_order(self):
        self.assertTrue(matches("step 1/2 ... tokens/s", "step 1/2 loss 2.5 | 99 tokens/s"))
        self.assertTrue(matches("\u2026 loss 2.5 \u2026", "step 1/2 loss 2.5 | 99 tokens/s"))
        self.assertFalse(matches("tokens/s ... step", "step 1/2 loss 2.5 | 99 tokens/s"))

    def test_white_space_next_to_an_ellipsis_does_not_count(self):
        self.assertTrue(matches('{"loss":2.4378, ...}', '{"loss":2.4378,"tokens":5}'))
        self.assertFalse(matches('{"loss":2.437, ...}', '{"loss":2.4378,"tokens":5}'))

    def test_a_line_of_only_an_ellipsis_stands_for_lines_left_out(self):
        self.assertTrue(check_doc_blocks.is_only_ellipsis(" ... "))
        self.assertFalse(check_doc_blocks.is_only_ellipsis("... x"))


class Documents(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.root = os.path.join(self.tmp.name, "repo")
        os.makedirs(os.path.join(self.root, "data"))
        open(os.path.join(self.root, "data", "text.txt"), "w").close()
        self.strata = os.path.join(self.tmp.name, "strata")
        with open(self.strata, "w") as f:
            f.write(FAKE_STRATA)
        os.chmod(self.strata, os.stat(self.strata).st_mode | stat.S_IXUSR)

    def tearDown(self):
        self.tmp.cleanup()

    def check(self, text, tier="run"):
        doc = os.path.join(self.root, "doc.md")
        with open(doc, "w") as f:
            f.write(textwrap.dedent(text))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = check_doc_blocks.main(["--root", self.root, "--strata", self.strata,
                                        "--tier", tier, doc])
        return rc, out.getvalue()

    def test_a_true_document_passes(self):
        rc, out = self.check("""\
            ```sh check=run
            strata train --steps 2 --save-dir runs/a/b      # a comment
            #   step 1/2 loss 2.5096 ...
            #   ...
            #   validation loss 2.4069 nats/token
            S=./build/release/tools/strata
            $S train \\
                --steps 2 --data data/text.txt
            #   done
            ```

            ```console check=run
            $ strata train --keep-last 3
            validation loss 2.4069 nats/token
            ```
            """)
        self.assertEqual(rc, 0, out)
        self.assertIn("2 blocks run, 0 parsed", out)

    def test_a_quoted_figure_the_binary_does_not_print_fails(self):
        rc, out = self.check("""\
            ```sh check=run
            strata train --steps 2
            #   validation loss 2.4070 nats/token
            ```
            """)
        self.assertEqual(rc, 1)
        self.assertIn("doc.md:3: quoted output not printed", out)

    def test_a_command_that_fails_fails_with_its_output(self):
        rc, out = self.check("""\
            ```console check=run
            $ strata estimate --model x
            verdict: feasible
            ```
            """)
        self.assertEqual(rc, 1)
        self.assertIn("doc.md:2: exited with status 3", out)
        self.assertIn("verdict: infeasible", out)

    def test_a_command_the_script_never_reached_fails(self):
        # A quote left open across lines: bash cannot parse the script, so nothing runs; that is
        # a failure naming the command, not a pass with nothing checked.
        rc, out = self.check("""\
            ```sh check=run
            python3 -c '
            print(1)' > x.txt
            strata train --steps 2
            #   validation loss 2.4069 nats/token
            ```
            """)
        self.assertEqual(rc, 1, out)
        self.assertIn("doc.md:2: did not run", out)

    def test_long_blocks_run_only_in_the_long_tier_and_are_parsed_in_the_default_one(self):
        text = """\
            ```sh check=long
            strata train --steps 2
            #   validation loss 9.9999 nats/token
            ```
            """
        rc, out = self.check(text, tier="run")
        self.assertEqual(rc, 0, out)
        self.assertIn("0 blocks run, 1 parsed", out)
        rc, out = self.check(text, tier="long")
        self.assertEqual(rc, 1)

    def test_a_parsed_block_with_an_unknown_flag_or_a_missing_path_fails(self):
        rc, out = self.check("""\
            ```sh check=parse
            mpirun -n 2 strata train --steps 2 --no-such-flag --data data/missing.bin
            strata train --data data/text.txt --save-dir=runs/x
            strata frobnicate --steps 2
            ```
            """)
        self.assertEqual(rc, 1)
        self.assertIn("`--no-such-flag` is not a flag of `strata train`", out)
        self.assertIn("`data/missing.bin` does not exist", out)
        self.assertIn("`strata frobnicate`: no such subcommand", out)
        self.assertNotIn("doc.md:3", out)

    def test_an_unmarked_command_block_fails_and_other_languages_need_no_mark(self):
        rc, out = self.check("""\
            ```sh
            strata train
            ```

            ```json
            {"a": 1}
            ```
            """)
        self.assertEqual(rc, 1)
        self.assertIn("doc.md:1: a command block without check=", out)
        self.assertNotIn("doc.md:5", out)

    def test_commands_write_nvme_paths_into_the_scratch_directory(self):
        rc, out = self.check("""\
            ```sh check=run
            mkdir -p /mnt/nvme0 && touch /mnt/nvme0/x && test -f "$STRATA_DOC_SCRATCH/mnt/nvme0/x"
            ```
            """)
        self.assertEqual(rc, 0, out)


if __name__ == "__main__":
    unittest.main()
