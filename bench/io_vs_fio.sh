#!/usr/bin/env bash
# Compares `strata iobench` with fio (--ioengine=io_uring --direct=1) on one file: same block
# size, queue depth and size, runs alternating, RUNS times each; prints per-config medians and the
# median ratios strata/fio of throughput (want >= 0.95) and CPU time per GB (want <= 1).
#
#   bench/io_vs_fio.sh [DIR] [SIZE]      DIR default /var/tmp, SIZE default 2GiB (fio: bytes)
#   env: STRATA=path/to/strata (default build/release/tools/strata), RUNS=5, KEEP_RAW=dir
#
# The file DIR/strata-iobench.0 is laid out once (written by fio) and shared: iobench reuses an
# existing strata-iobench.<i> file and leaves it in place; this script removes it at the end.
set -euo pipefail

DIR=${1:-/var/tmp}
SIZE=${2:-2GiB}
RUNS=${RUNS:-5}
STRATA=${STRATA:-build/release/tools/strata}
FILE="$DIR/strata-iobench.0"
RAW=$(mktemp -d "${TMPDIR:-/tmp}/io_vs_fio.XXXXXX")

command -v fio >/dev/null || { echo "io_vs_fio: fio not found (apt-get install fio)" >&2; exit 1; }
[ -x "$STRATA" ] || { echo "io_vs_fio: $STRATA not built (cmake --build build/release --target strata)" >&2; exit 1; }
[ -e "$FILE" ] && { echo "io_vs_fio: $FILE exists; remove it first" >&2; exit 1; }
cleanup() { rm -f "$FILE"; if [ -n "${KEEP_RAW:-}" ]; then cp -r "$RAW" "$KEEP_RAW"; fi; rm -rf "$RAW"; }
trap cleanup EXIT

SIZE_BYTES=$(python3 -c '
import re,sys
m=re.fullmatch(r"(\d+)(B|KiB|MiB|GiB|TiB)?", sys.argv[1]) or sys.exit("io_vs_fio: SIZE like 2GiB")
print(int(m.group(1)) * {None:1,"B":1,"KiB":1<<10,"MiB":1<<20,"GiB":1<<30,"TiB":1<<40}[m.group(2)])' "$SIZE")

echo "# laying out $FILE ($SIZE_BYTES bytes)" >&2
fio --name=layout --filename="$FILE" --rw=write --bs=1048576 --size="$SIZE_BYTES" --direct=1 \
    --ioengine=io_uring --iodepth=32 --output=/dev/null

CONFIGS=("1048576 8" "1048576 32" "131072 32")
for rw in read write; do
  for cfg in "${CONFIGS[@]}"; do
    set -- $cfg
    bs=$1 qd=$2
    for i in $(seq 1 "$RUNS"); do
      echo "# $rw bs=$bs qd=$qd run $i/$RUNS" >&2
      fio --name=cmp --filename="$FILE" --rw="$rw" --bs="$bs" --iodepth="$qd" \
          --size="$SIZE_BYTES" --direct=1 --ioengine=io_uring --numjobs=1 \
          --output-format=json --output="$RAW/fio.$rw.$bs.$qd.$i.json"
      "$STRATA" iobench --path "$DIR" --rw "$rw" --block-size "$bs" --queue-depth "$qd" \
          --size "$SIZE_BYTES" --backend uring --threads 1 --loops 1 --json \
          > "$RAW/strata.$rw.$bs.$qd.$i.json"
    done
  done
done

python3 - "$RAW" <<'PY'
import glob, json, os, statistics, sys
raw = sys.argv[1]
rows = {}
for path in glob.glob(os.path.join(raw, "*.json")):
    tool, rw, bs, qd, _, _ = os.path.basename(path).split(".")
    with open(path) as f:
        if tool == "fio":
            job = json.load(f)["jobs"][0]
            side = job[rw]
            gbps = side["bw_bytes"] / 1e9
            cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * job["job_runtime"] / 1000.0
            cpu_per_gb = cpu_s / (side["io_bytes"] / 1e9)
        else:
            r = json.loads(f.read().strip().splitlines()[-1])
            gbps, cpu_per_gb = r["gb_per_s"], r["cpu_s_per_gb"]
    d = rows.setdefault((rw, int(bs), int(qd)), {"fio": ([], []), "strata": ([], [])})
    d[tool][0].append(gbps)
    d[tool][1].append(cpu_per_gb)
med = statistics.median
print(f"{'rw':<6}{'bs':>8}{'qd':>4}  {'fio GB/s':>9} {'strata GB/s':>11} {'ratio':>6}"
      f"  {'fio CPU s/GB':>12} {'strata CPU s/GB':>15} {'ratio':>6}  runs")
for (rw, bs, qd) in sorted(rows, key=lambda k: (k[0], -k[1], k[2])):
    d = rows[(rw, bs, qd)]
    fg, sg = med(d["fio"][0]), med(d["strata"][0])
    fc, sc = med(d["fio"][1]), med(d["strata"][1])
    # Median of the per-run ratios (runs alternate, so run i of each tool saw similar conditions).
    tr = med([s / f for s, f in zip(d["strata"][0], d["fio"][0])])
    cr = med([s / f for s, f in zip(d["strata"][1], d["fio"][1]) if f > 0] or [float("nan")])
    bs_txt = f"{bs >> 20}MiB" if bs >= 1 << 20 else f"{bs >> 10}KiB"
    print(f"{rw:<6}{bs_txt:>8}{qd:>4}  {fg:9.3f} {sg:11.3f} {tr:6.3f}  {fc:12.4f} {sc:15.4f} {cr:6.3f}"
          f"  {len(d['fio'][0])}")
PY
