"""`strata train`'s metrics files read back as TensorBoard and a script would (issue 17).

Runs a short training (3 steps, validation every 2) on the host device with
--tensorboard-dir, --metrics-jsonl and --metrics-csv-dir, then:

- the event file: named events.out.tfevents.<seconds>.<host>.<pid>.0; every
  record's TFRecord framing and both masked CRC-32Cs check out (CRC-32C computed
  here bit by bit, itself checked against RFC 3720's vectors); the records parse
  as TensorBoard's Event messages; the first is file_version "brain.Event:2";
  every tag is there at every step 1..3, val/loss at steps 2 and 3;
- the JSON lines hold the same records in the same order with the same values
  (the event file stores float32: each JSON value rounds to the event's value);
- the CSV files (one per tag, header "step,<tag>") hold the JSON lines' values;
- the losses agree with --summary-json's loss_first, loss_last and val_loss;
- an unusable --tensorboard-dir fails before training with one line naming it.

The Event / Summary classes are built here with the protobuf descriptor API from
TensorBoard's published field numbers (tensorboard/compat/proto/event.proto and
summary.proto), not from Strata's own .proto, so a wrong field number in Strata
fails this test. Needs no torch. Exits 77 (CTest SKIP_RETURN_CODE) when
google.protobuf is not importable or STRATA_CLI does not name the strata binary.
"""

import csv
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

try:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
except ImportError as _e:  # the __main__ block reports this and exits 77
    descriptor_pb2 = None
    _IMPORT_ERROR = _e

SKIP = 77
STRATA = os.environ.get("STRATA_CLI", "")

STEP_TAGS = [
    "train/loss", "train/lr", "train/grad_norm", "train/loss_scale", "train/tokens_per_second",
    "train/skipped", "bytes/h2d", "bytes/d2h", "bytes/nvme_read", "bytes/nvme_write",
    "time/compute", "time/h2d", "time/d2h", "time/cpu_optimizer", "time/nvme_read",
    "time/nvme_write", "time/comm", "time/step",
]


def crc32c(data):
    """CRC-32C (Castagnoli, reflected 0x82F63B78), one bit at a time."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data):
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def read_records(path, test):
    """Payloads of a TFRecord file, every length and CRC checked."""
    with open(path, "rb") as f:
        data = f.read()
    records, pos = [], 0
    while pos < len(data):
        test.assertGreaterEqual(len(data) - pos, 16, f"truncated header at byte {pos}")
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        test.assertEqual(length_crc, masked_crc32c(header), f"length CRC at byte {pos}")
        test.assertLessEqual(pos + 16 + length, len(data), f"truncated record at byte {pos}")
        payload = data[pos + 12:pos + 12 + length]
        (data_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
        test.assertEqual(data_crc, masked_crc32c(payload), f"data CRC at byte {pos}")
        records.append(payload)
        pos += 16 + length
    return records


def tensorboard_event_class():
    """TensorBoard's Event message (the fields Strata writes), built by field number."""
    F = descriptor_pb2.FieldDescriptorProto
    fd = descriptor_pb2.FileDescriptorProto(name="strata_test_tb_event.proto",
                                            package="strata_test_tb", syntax="proto3")
    summary = fd.message_type.add(name="Summary")
    value = summary.nested_type.add(name="Value")
    value.oneof_decl.add(name="value")
    value.field.add(name="tag", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    value.field.add(name="simple_value", number=2, type=F.TYPE_FLOAT, label=F.LABEL_OPTIONAL,
                    oneof_index=0)
    summary.field.add(name="value", number=1, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED,
                      type_name=".strata_test_tb.Summary.Value")
    event = fd.message_type.add(name="Event")
    event.oneof_decl.add(name="what")
    event.field.add(name="wall_time", number=1, type=F.TYPE_DOUBLE, label=F.LABEL_OPTIONAL)
    event.field.add(name="step", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    event.field.add(name="file_version", number=3, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL,
                    oneof_index=0)
    event.field.add(name="summary", number=5, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL,
                    type_name=".strata_test_tb.Summary", oneof_index=0)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    desc = pool.FindMessageTypeByName("strata_test_tb.Event")
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(pool).GetPrototype(desc)


def as_float32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


class Crc32cReferenceTest(unittest.TestCase):
    def test_matches_rfc3720_vectors(self):
        self.assertEqual(crc32c(bytes(32)), 0x8A9136AA)
        self.assertEqual(crc32c(b"\xff" * 32), 0x62A8AB43)
        self.assertEqual(crc32c(bytes(range(32))), 0x46DD794E)
        self.assertEqual(crc32c(b"123456789"), 0xE3069283)


@unittest.skipUnless(STRATA and os.access(STRATA, os.X_OK), "STRATA_CLI is not the strata binary")
class TrainMetricsFilesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="strata_metrics_py_")
        cls.tb_dir = os.path.join(cls.dir, "tb", "job")
        cls.jsonl = os.path.join(cls.dir, "metrics.jsonl")
        cls.csv_dir = os.path.join(cls.dir, "csv", "job")
        cls.summary = os.path.join(cls.dir, "summary.json")
        cmd = [STRATA, "train", "--model", "tiny", "--steps", "3", "--eval-every", "2",
               "--eval-batches", "2", "--seq-len", "16", "--grad-accum-steps", "2",
               "--sample-bytes", "0", "--device", "host", "--offload-optimizer", "host",
               "--offload-params", "host", "--tensorboard-dir", cls.tb_dir,
               "--metrics-jsonl", cls.jsonl, "--metrics-csv-dir", cls.csv_dir,
               "--summary-json", cls.summary]
        cls.train = subprocess.run(cmd, cwd=cls.dir, capture_output=True, text=True, timeout=300)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def setUp(self):
        self.assertEqual(self.train.returncode, 0, self.train.stdout + self.train.stderr)

    def events(self):
        names = os.listdir(self.tb_dir)
        self.assertEqual(len(names), 1, names)
        self.assertRegex(names[0], r"^events\.out\.tfevents\.\d{10,}\.[^/]+\.\d+\.0$")
        Event = tensorboard_event_class()
        out = []
        for payload in read_records(os.path.join(self.tb_dir, names[0]), self):
            e = Event()
            e.ParseFromString(payload)
            out.append(e)
        return out

    def json_lines(self):
        with open(self.jsonl) as f:
            return [json.loads(line) for line in f]

    def test_event_file_has_every_tag_at_every_step(self):
        events = self.events()
        self.assertEqual(events[0].WhichOneof("what"), "file_version")
        self.assertEqual(events[0].file_version, "brain.Event:2")
        tags_at = {}
        for e in events[1:]:
            self.assertEqual(e.WhichOneof("what"), "summary")
            for v in e.summary.value:
                self.assertEqual(v.WhichOneof("value"), "simple_value")
                tags_at.setdefault(e.step, {})[v.tag] = v.simple_value
        self.assertEqual(sorted(tags_at), [1, 2, 3])
        for step in (1, 2, 3):
            expected = set(STEP_TAGS) | ({"val/loss"} if step in (2, 3) else set())
            self.assertEqual(set(tags_at[step]), expected, f"step {step}")
            s = tags_at[step]
            self.assertTrue(math.isfinite(s["train/loss"]) and 0 < s["train/loss"] < 10, s)
            self.assertTrue(0 < s["val/loss"] < 10 if step > 1 else True, s)
            self.assertGreater(s["train/lr"], 0)
            self.assertEqual(s["train/skipped"], 0.0)
            self.assertEqual(s["train/loss_scale"], 1.0)  # bf16: no loss scaling
            self.assertGreater(s["bytes/d2h"], 0)  # the gradients come down every step
            self.assertEqual(s["bytes/nvme_read"], 0.0)  # nothing lives on NVMe
            self.assertEqual(s["bytes/nvme_write"], 0.0)
            self.assertGreater(s["time/step"], 0)
            self.assertGreater(s["time/compute"], 0)
            self.assertGreater(s["train/tokens_per_second"], 0)
        # The warmup schedule raises the learning rate over these steps.
        self.assertLess(tags_at[1]["train/lr"], tags_at[2]["train/lr"])
        self.assertLess(tags_at[2]["train/lr"], tags_at[3]["train/lr"])

    def test_json_lines_hold_the_same_records_and_values(self):
        events = self.events()[1:]
        lines = self.json_lines()
        self.assertEqual(len(lines), len(events))
        self.assertEqual(len(lines), 5)  # 3 steps + 2 validations
        for line, e in zip(lines, events):
            self.assertEqual(list(line)[:2], ["step", "wall_time"])
            self.assertEqual(line["step"], e.step)
            self.assertEqual(line["wall_time"], e.wall_time)
            self.assertEqual(set(line) - {"step", "wall_time"}, {v.tag for v in e.summary.value})
            for v in e.summary.value:
                self.assertEqual(as_float32(line[v.tag]), v.simple_value, f"{v.tag} at {e.step}")

    def test_csv_files_hold_the_json_lines_values(self):
        lines = self.json_lines()
        tags = set(STEP_TAGS) | {"val/loss"}
        self.assertEqual(sorted(os.listdir(self.csv_dir)),
                         sorted(t.replace("/", "_") + ".csv" for t in tags))
        for tag in tags:
            with open(os.path.join(self.csv_dir, tag.replace("/", "_") + ".csv")) as f:
                rows = list(csv.reader(f))
            self.assertEqual(rows[0], ["step", tag])
            expected = [(l["step"], l[tag]) for l in lines if tag in l]
            self.assertEqual([(int(r[0]), float(r[1])) for r in rows[1:]], expected, tag)

    def test_losses_agree_with_the_summary(self):
        with open(self.summary) as f:
            summary = json.load(f)
        steps = [l for l in self.json_lines() if "train/loss" in l]
        vals = [l for l in self.json_lines() if "val/loss" in l]
        self.assertEqual(steps[0]["train/loss"], summary["loss_first"])
        self.assertEqual(steps[-1]["train/loss"], summary["loss_last"])
        self.assertEqual([v["step"] for v in vals], [2, 3])
        self.assertEqual(vals[-1]["val/loss"], summary["val_loss"])
        self.assertEqual(sum(l["train/skipped"] for l in steps), summary["skipped_steps"])
        # Per-step traffic adds up to the run's (no evaluation traffic in the steps; the
        # evaluations here move less than the run's total, so the sum must stay below it).
        self.assertLessEqual(sum(l["bytes/d2h"] for l in steps), summary["bytes_d2h"])


@unittest.skipUnless(STRATA and os.access(STRATA, os.X_OK), "STRATA_CLI is not the strata binary")
class BadMetricsPathTest(unittest.TestCase):
    def test_unusable_tensorboard_dir_fails_before_training_naming_the_flag(self):
        with tempfile.TemporaryDirectory(prefix="strata_metrics_bad_") as d:
            blocker = os.path.join(d, "a_file")
            with open(blocker, "w") as f:
                f.write("x")
            bad = os.path.join(blocker, "tb")
            r = subprocess.run([STRATA, "train", "--model", "tiny", "--steps", "1",
                                "--device", "host", "--tensorboard-dir", bad],
                               cwd=d, capture_output=True, text=True, timeout=120)
            self.assertNotEqual(r.returncode, 0)
            err = r.stderr.strip().splitlines()
            self.assertEqual(len(err), 1, r.stderr)
            self.assertIn("--tensorboard-dir", err[0])
            self.assertIn(bad, err[0])
            self.assertNotIn("step", r.stdout)


if __name__ == "__main__":
    if descriptor_pb2 is None:
        print(f"SKIPPED: google.protobuf is not importable by {sys.executable} ({_IMPORT_ERROR}); "
              "install python3-protobuf (Debian) to run the metrics file tests")
        sys.exit(SKIP)
    if not (STRATA and os.access(STRATA, os.X_OK)):
        print("SKIPPED: STRATA_CLI does not name the strata binary")
        sys.exit(SKIP)
    unittest.main(verbosity=2)
