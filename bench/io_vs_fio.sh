#!/usr/bin/env bash
# Compares `strata iobench` with fio (--ioengine=io_uring --direct=1) on one file: same block
# size, queue depth and size. fio runs twice per round: with its default buffers (malloc, 4 KiB
# pages) and with buffers on huge pages (--mem=shmhuge), as Strata's are (transparent huge pages).
# On a virtio disk the page size matters: virtio-blk takes at most 254 segments per request, so a
# 1 MiB request from 4 KiB pages is split in two. The three runs of a round go in a rotating order,
# RUNS rounds per configuration; prints per-config medians, the median of the per-round ratios
# strata/fio for throughput (want >= 0.95) and CPU time per GB (want <= 1), and a verdict for
# sequential 1 MiB QD32 against huge-page fio.
#
# A last row, "1stwr", compares first writes (1 MiB QD32): fio writing a file it has just created
# (fio fallocates a new file: the writes land in allocated but unwritten extents) against
# `strata iobench --first-write` on that file (it deallocates and fallocates it again before
# writing), the state of a swap store's extent at its first write. Set FIRST_WRITE=0 to skip it.
#
#   bench/io_vs_fio.sh [DIR] [SIZE]      DIR default /var/tmp, SIZE default 2GiB (fio: bytes)
#   env: STRATA=path/to/strata (default build/release/tools/strata), RUNS=5, KEEP_RAW=dir
#
# DIR must be on the disk under test (not tmpfs: fio and Strata would measure memory). The file
# DIR/strata-iobench.0 is laid out once (written by fio) and shared, so every write is an overwrite
# for both tools (iobench reuses an existing strata-iobench.<i> and leaves it in place; this script
# removes it at the end). fio is installed with apt-get when missing and we are root.
# --mem=shmhuge needs reserved huge pages (vm.nr_hugepages): the script reserves what it needs when
# it can (root) and gives the reservation back at exit; otherwise it says why and compares with
# fio's default buffers only.
set -euo pipefail

DIR=${1:-/var/tmp}
SIZE=${2:-2GiB}
RUNS=${RUNS:-5}
FIRST_WRITE=${FIRST_WRITE:-1}
STRATA=${STRATA:-build/release/tools/strata}
FILE="$DIR/strata-iobench.0"
FW_DIR="$DIR/io_vs_fio.first-write"  # the first-write file, FW_DIR/strata-iobench.0
CONFIGS=("1048576 32" "1048576 8" "131072 32")

die() { echo "io_vs_fio: $*" >&2; exit 1; }

if ! command -v fio >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "# fio not found: apt-get install -y fio" >&2
    apt-get install -y fio >/dev/null 2>&1 || { apt-get update >/dev/null 2>&1 && apt-get install -y fio >/dev/null 2>&1; } ||
      die "apt-get install fio failed"
  else
    die "fio not found (apt-get install fio)"
  fi
fi
[ -x "$STRATA" ] || die "$STRATA not built (cmake --build build/release --target strata)"
[ -d "$DIR" ] || die "$DIR is not a directory"
FSTYPE=$(stat -f -c %T "$DIR")
case "$FSTYPE" in
  tmpfs | ramfs) die "$DIR is on $FSTYPE (memory, not a disk): pick a directory on the drive (see df)" ;;
esac
[ -e "$FILE" ] && die "$FILE exists; remove it first"
[ -e "$FW_DIR" ] && die "$FW_DIR exists; remove it first"

SIZE_BYTES=$(python3 -c '
import re,sys
m=re.fullmatch(r"(\d+)(B|KiB|MiB|GiB|TiB)?", sys.argv[1]) or sys.exit("io_vs_fio: SIZE like 2GiB")
print(int(m.group(1)) * {None:1,"B":1,"KiB":1<<10,"MiB":1<<20,"GiB":1<<30,"TiB":1<<40}[m.group(2)])' "$SIZE")

# Huge pages for fio --mem=shmhuge: fio takes one SysV segment of iodepth x bs (+ alignment)
# rounded up to huge pages. Reserve the largest configuration's need plus slack.
HP_KB=$(awk '/^Hugepagesize:/ {print $2}' /proc/meminfo)
HP_NEED=0
for cfg in "${CONFIGS[@]}"; do
  set -- $cfg
  n=$(( ($1 * $2 + 2 * HP_KB * 1024 + HP_KB * 1024 - 1) / (HP_KB * 1024) ))
  [ "$n" -gt "$HP_NEED" ] && HP_NEED=$n
done
hp_free() { awk '/^HugePages_Free:/ {print $2}' /proc/meminfo; }
HP_ORIG=$(cat /proc/sys/vm/nr_hugepages)
HP_CHANGED=0
HUGE=1
HUGE_WHY=""
if [ "$(hp_free)" -lt "$HP_NEED" ]; then
  want=$(( HP_ORIG + HP_NEED - $(hp_free) ))
  if [ -w /proc/sys/vm/nr_hugepages ] && echo "$want" >/proc/sys/vm/nr_hugepages 2>/dev/null; then
    HP_CHANGED=1
    if [ "$(hp_free)" -lt "$HP_NEED" ]; then
      HUGE=0
      HUGE_WHY="asked the kernel for $want huge pages of ${HP_KB} kB, got $(cat /proc/sys/vm/nr_hugepages) (memory too fragmented or too small)"
    fi
  else
    HUGE=0
    HUGE_WHY="$(hp_free) free huge pages of ${HP_KB} kB, $HP_NEED needed, and /proc/sys/vm/nr_hugepages is not writable (run as root, or: sysctl -w vm.nr_hugepages=$want)"
  fi
fi

RAW=$(mktemp -d "${TMPDIR:-/tmp}/io_vs_fio.XXXXXX")
cleanup() {
  rm -f "$FILE"
  rm -rf "$FW_DIR"
  [ "$HP_CHANGED" = 1 ] && echo "$HP_ORIG" >/proc/sys/vm/nr_hugepages
  if [ -n "${KEEP_RAW:-}" ]; then cp -r "$RAW" "$KEEP_RAW"; fi
  rm -rf "$RAW"
}
trap cleanup EXIT

if [ "$HUGE" = 1 ]; then
  echo "# huge pages: $(hp_free) free (${HP_KB} kB), fio --mem=shmhuge runs too" >&2
else
  echo "# WARNING: no fio --mem=shmhuge runs: $HUGE_WHY" >&2
fi
echo "# $DIR: $FSTYPE on $(df --output=source "$DIR" | tail -1); fio $(fio --version); $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
echo "# laying out $FILE ($SIZE_BYTES bytes)" >&2
fio --name=layout --filename="$FILE" --rw=write --bs=1048576 --size="$SIZE_BYTES" --direct=1 \
    --ioengine=io_uring --iodepth=32 --output=/dev/null

TOOLS=(fio strata)
[ "$HUGE" = 1 ] && TOOLS=(fio fiohuge strata)
run_tool() {  # tool rw bs qd i; rw "1stwr": a first write (see the top)
  local tool=$1 rw=$2 bs=$3 qd=$4 i=$5
  local file=$FILE fiorw=$rw path=$DIR first=""
  if [ "$rw" = 1stwr ]; then
    file="$FW_DIR/strata-iobench.0" fiorw=write path=$FW_DIR first=--first-write
    [ "$tool" != strata ] && rm -f "$file"  # fio creates and fallocates it anew
  fi
  case "$tool" in
    fio | fiohuge)
      local mem=malloc
      [ "$tool" = fiohuge ] && mem=shmhuge
      fio --name=cmp --filename="$file" --rw="$fiorw" --bs="$bs" --iodepth="$qd" \
          --size="$SIZE_BYTES" --direct=1 --ioengine=io_uring --numjobs=1 --mem="$mem" \
          --output-format=json --output="$RAW/$tool.$rw.$bs.$qd.$i.json" ;;
    strata)
      "$STRATA" iobench --path "$path" --rw "$fiorw" --block-size "$bs" --queue-depth "$qd" \
          --size "$SIZE_BYTES" --backend uring --threads 1 --loops 1 --json $first \
          > "$RAW/strata.$rw.$bs.$qd.$i.json" ;;
  esac
}

PLAN=()
for rw in write read; do
  for cfg in "${CONFIGS[@]}"; do PLAN+=("$rw $cfg"); done
done
if [ "$FIRST_WRITE" = 1 ]; then
  mkdir -p "$FW_DIR"
  PLAN+=("1stwr 1048576 32")
fi
for item in "${PLAN[@]}"; do
  set -- $item
  rw=$1
  bs=$2 qd=$3
  for i in $(seq 1 "$RUNS"); do
    echo "# $rw bs=$bs qd=$qd round $i/$RUNS" >&2
    n=${#TOOLS[@]}
    for k in $(seq 0 $((n - 1))); do  # rotate the order: each tool goes first in turn
      run_tool "${TOOLS[$(( (i + k) % n ))]}" "$rw" "$bs" "$qd" "$i"
    done
  done
done

python3 - "$RAW" "$HUGE" <<'PY'
import glob, json, os, statistics, sys
raw, huge = sys.argv[1], sys.argv[2] == "1"
rows = {}
for path in glob.glob(os.path.join(raw, "*.json")):
    tool, rw, bs, qd, i, _ = os.path.basename(path).split(".")
    with open(path) as f:
        if tool.startswith("fio"):
            job = json.load(f)["jobs"][0]
            side = job["write" if rw == "1stwr" else rw]
            gbps = side["bw_bytes"] / 1e9
            cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * job["job_runtime"] / 1000.0
            cpu_per_gb = cpu_s / (side["io_bytes"] / 1e9)
        else:
            r = json.loads(f.read().strip().splitlines()[-1])
            gbps, cpu_per_gb = r["gb_per_s"], r["cpu_s_per_gb"]
    rows.setdefault((rw, int(bs), int(qd)), {}).setdefault(tool, {})[int(i)] = (gbps, cpu_per_gb)
med = statistics.median

def ratios(d, ref, k):
    # Median of the per-round ratios (a round runs the tools back to back: similar conditions).
    r = [d["strata"][i][k] / d[ref][i][k] for i in d["strata"] if i in d[ref] and d[ref][i][k] > 0]
    return med(r) if r else float("nan")

refs = [("fio", "fio 4K pages")] + ([("fiohuge", "fio huge pages")] if huge else [])
head = f"{'rw':<6}{'bs':>7}{'qd':>4} " + "".join(f"{'fio GB/s':>9}" if t == "fio" else f"{'fioH GB/s':>10}" for t, _ in refs)
head += f"{'strata':>8}" + "".join(f"{'/fio':>7}" if t == "fio" else f"{'/fioH':>7}" for t, _ in refs)
head += " |" + "".join(f"{'fio s/GB':>9}" if t == "fio" else f"{'fioH s/GB':>10}" for t, _ in refs)
head += f"{'strata':>8}" + "".join(f"{'/fio':>7}" if t == "fio" else f"{'/fioH':>7}" for t, _ in refs) + "  runs"
print("throughput GB/s (1e9 B/s) and CPU s/GB: per-tool medians; /fio, /fioH: median of per-round "
      "strata/fio ratios (fioH: fio --mem=shmhuge)")
print(head)
verdict = {}
for (rw, bs, qd) in sorted(rows, key=lambda k: ({"write": 0, "read": 1}.get(k[0], 2), -k[1], -k[2])):
    d = rows[(rw, bs, qd)]
    bs_txt = f"{bs >> 20}MiB" if bs >= 1 << 20 else f"{bs >> 10}KiB"
    line = f"{rw:<6}{bs_txt:>7}{qd:>4} "
    for t, _ in refs:
        line += (f"{med(v[0] for v in d[t].values()):9.3f}" if t == "fio" else
                 f"{med(v[0] for v in d[t].values()):10.3f}")
    line += f"{med(v[0] for v in d['strata'].values()):8.3f}"
    for t, _ in refs:
        line += f"{ratios(d, t, 0):7.3f}"
    line += " |"
    for t, _ in refs:
        line += (f"{med(v[1] for v in d[t].values()):9.4f}" if t == "fio" else
                 f"{med(v[1] for v in d[t].values()):10.4f}")
    line += f"{med(v[1] for v in d['strata'].values()):8.4f}"
    for t, _ in refs:
        line += f"{ratios(d, t, 1):7.3f}"
    print(line + f"  {len(d['strata'])}")
    if bs == 1 << 20 and qd == 32 and rw != "1stwr":
        verdict[rw] = ratios(d, refs[-1][0], 0)
ref_name = refs[-1][1]
ok = all(v >= 0.95 for v in verdict.values())
print(f"sequential 1MiB QD32, strata / {ref_name} (median of per-round ratios): " +
      ", ".join(f"{rw} {v:.3f}" for rw, v in sorted(verdict.items(), reverse=True)) +
      (" -- >= 0.95: OK" if ok else " -- below 0.95"))
if not huge:
    print("(no huge-page fio runs: see the WARNING above)")
PY
