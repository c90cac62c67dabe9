#!/usr/bin/env bash
# Device check (issue 33): what a lent GPU can tell about dynamic MIG without switching anything.
# Run it on a GPU node, as root, from the repository root:
#
#   bash tests/device/mig-readonly.sh [NVDRA]   # the report on stdout and in $OUT/mig-readonly.txt
#
# It is strictly read-only: it never changes MIG mode, the compute mode or any other GPU setting,
# never creates or destroys an instance, never resets a GPU and never signals a process. Its
# nvidia-smi calls are queries (-q, --query-gpu, --query-compute-apps, mig -lgip, mig -lgipp);
# its NVML calls (tests/device/nvml_probe.py, ctypes on libnvidia-ml.so.1) are reads and an
# event set of its own; nvdra runs only as `nvdra inventory`. At the end it checks that MIG mode
# and the compute mode are as they were.
#
# The checks, each reported as PASS, FAIL, INFO, SKIP (and DIFF lines under a FAIL):
#   virtualization  bare metal, a passthrough VM or a vGPU guest, by nvidia-smi -q ("GPU
#                   Virtualization Mode"), by NVML through ctypes and by `nvdra inventory -o
#                   yaml` (`virtualization`); FAIL where nvdra disagrees with NVML. Also what
#                   nvdra's MIG TOGGLE column says (FAIL if it would switch a vGPU guest).
#   placements      NVML's GPU-instance profiles and placements (nvidia-smi mig -lgip/-lgipp:
#                   whether they answer with MIG off is recorded; and the ctypes reads) against
#                   nvdra's tables (`mig.profiles` in `nvdra inventory -o yaml`): ids, names,
#                   instance counts, SMs, memory, placements; FAIL with a DIFF line for each
#                   difference.
#   timing          wall time of `nvdra inventory`, of nvidia-smi -q and friends, and of each
#                   NVML call (first call, median and max over REPEAT calls).
#   holders         which processes hold the GPU: /proc/*/fd links to $DEV_ROOT/nvidia<minor>
#                   (and nvidiactl, nvidia-uvm, nvidia-caps), with their names, known holders
#                   named (nv-hostengine = DCGM, dcgm-exporter, nvidia-persistenced, nvsm, MPS),
#                   NVML's compute processes, and the holders `nvdra inventory --dynamic-mig`
#                   names; FAIL where a known blocking holder (DCGM, NVSM) holds the GPU in both
#                   scans and nvdra's NVML read, which names holders, does not name it.
#   events          an event set registered for critical XIDs (and nvdra's mask), one wait of
#                   WAIT_MS (a timeout is expected), then freed; FAIL if registration fails
#                   with anything but NOT_SUPPORTED.
#   settings        MIG mode (current and pending) and compute mode before and after; FAIL if
#                   they changed while it ran (not by this check).
# It ends with the checks that need a machine where switching MIG mode is allowed.
#
# Settings (environment): NVDRA (nvdra's binary, also the first argument; target/release/nvdra),
# NVDRA_ARGS (more `nvdra inventory` arguments, word-split; e.g. "--profile dgx-h100" runs it on
# the simulated node, as tests/integration/device_check.rs does), NVML_LIB (the library the ctypes
# probe loads; libnvidia-ml.so.1), PYTHON (python3; without it the NVML reads are skipped with a
# SKIP line), DEV_ROOT (where the device files are; /dev), GPUS (NVML indexes, comma-separated;
# all), REPEAT (5), WAIT_MS (100), OUT (where the report goes; /tmp). Exit 0 when nothing failed, 1
# when a check failed, 2 when this is not a GPU node or a setting is malformed. Takes a few seconds
# per GPU (nvidia-smi -q is the slowest part without persistence mode).
#
# On the device tool, whose carried paths hold 64 MiB at most, carry a stripped nvdra:
#   strip -o target/nvdra-stripped target/release/nvdra   # here; then run with carry
#   ["target/nvdra-stripped"]: OUT=$OUT bash tests/device/mig-readonly.sh target/nvdra-stripped
#
# tests/integration/device_check.rs runs it here on stand-ins (a stand-in nvidia-smi answering in
# nvidia-smi's documented formats, nvdra's simulated backend, the fake NVML, a process named
# nv-hostengine holding a stand-in device file), so that a lent GPU's time is not spent on a
# broken script.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
nvdra=${1:-${NVDRA:-$root/target/release/nvdra}}
read -r -a nvdra_args <<<"${NVDRA_ARGS:-}"
nvml_lib=${NVML_LIB:-libnvidia-ml.so.1}
py=${PYTHON:-python3}
dev_root=${DEV_ROOT:-/dev}
repeat=${REPEAT:-5}
wait_ms=${WAIT_MS:-100}
out_dir=${OUT:-/tmp}
report=$out_dir/mig-readonly.txt

fails=0
say() { # LEVEL CHECK TEXT: one report line
  local line
  line=$(printf '%-4s %-14s %s' "$1" "$2" "$3")
  echo "$line"
  echo "$line" >>"$report"
  if [ "$1" = FAIL ]; then fails=$((fails + 1)); fi
}
die() { # TEXT: not something this check can run on
  say FAIL setup "$1"
  exit 2
}

case "$repeat$wait_ms" in *[!0-9]*) die "REPEAT and WAIT_MS must be whole numbers (got ${repeat}, ${wait_ms})" ;; esac
case "${GPUS:-0}" in *[!0-9,]*) die "GPUS must list NVML indexes, comma-separated (got ${GPUS})" ;; esac
mkdir -p "$out_dir"
: >"$report"
work=$(mktemp -d "${TMPDIR:-/tmp}/migro.XXXXXX")
trap 'rm -rf "$work"' EXIT

find_bin() {
  local d
  for d in $(echo "$PATH" | tr : ' ') /usr/local/nvidia/bin /usr/bin /usr/local/bin /bin; do
    if [ -x "$d/$1" ]; then echo "$d/$1"; return 0; fi
  done
  return 1
}
now_ns() { date +%s%N; }
ms_since() { awk -v a="$1" -v b="$(now_ns)" 'BEGIN { printf "%.1f", (b - a) / 1e6 }'; }
# timed NAME CMD...: runs CMD (stdout to $work/NAME, stderr to $work/NAME.err) under a deadline;
# sets rc and ms, never fails.
timed() {
  local name=$1 t0
  shift
  t0=$(now_ns)
  rc=0
  timeout 120 "$@" >"$work/$name" 2>"$work/$name.err" </dev/null || rc=$?
  ms=$(ms_since "$t0")
}
first_line() { head -n 1 "$1" 2>/dev/null | cut -c1-200; }

smi=$(find_bin nvidia-smi) || die "no nvidia-smi on PATH: not a GPU node"
[ -x "$nvdra" ] || die "no nvdra binary at $nvdra (build it: cargo build --release, or set NVDRA)"
dev_root=$(cd "$dev_root" 2>/dev/null && pwd -P) || die "DEV_ROOT ${DEV_ROOT:-/dev} is not a directory"

# The GPUs, and the settings this check must leave as they were.
settings() { # FILE
  timeout 60 "$smi" --query-gpu=index,uuid,mig.mode.current,mig.mode.pending,compute_mode,name \
    --format=csv,noheader 2>/dev/null | awk -F', ' -v OFS='\t' 'NF >= 6 {
      name = $6; for (i = 7; i <= NF; i++) name = name ", " $i
      print $1, $2, $3, $4, $5, name }' >"$1" || true
}
settings "$work/gpus.before"
[ -s "$work/gpus.before" ] || die "nvidia-smi --query-gpu lists no GPU: $($smi -L 2>&1 | head -n 1)"
if [ -n "${GPUS:-}" ]; then
  selected=$(echo "$GPUS" | tr , '\n')
else
  selected=$(cut -f1 "$work/gpus.before")
fi
gpu_field() { # INDEX FIELD(2 uuid, 3 mig current, 4 pending, 5 compute mode, 6 name)
  awk -F'\t' -v i="$1" -v f="$2" '$1 == i { print $f }' "$work/gpus.before"
}
for i in $selected; do
  [ -n "$(gpu_field "$i" 2)" ] || die "GPUS names GPU $i, which nvidia-smi does not list"
done

# ----------------------------------------------------------------------------------------------
# Gathering: every command first (the holder scans bracket nvdra's read, with nothing of ours
# holding a GPU meanwhile), the report after.

# scan_holders FILE: "pid TAB comm TAB exe TAB device file" for each NVIDIA device file open.
scan_holders() {
  local fd pid target comm exe
  : >"$1"
  { find /proc/[0-9]*/fd -maxdepth 1 -type l -lname "$dev_root/nvidia*" -printf '%h\t%l\n' \
    2>/dev/null || true; } | sort -u | while IFS=$'\t' read -r fd target; do
    pid=${fd#/proc/}
    pid=${pid%/fd}
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || continue
    exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || exe="?"
    printf '%s\t%s\t%s\t%s\n' "$pid" "$comm" "${exe##*/}" "$target" >>"$1"
  done
}
unreadable=0
for d in /proc/[0-9]*; do
  if [ -d "$d" ] && [ ! -r "$d/fd" ]; then unreadable=$((unreadable + 1)); fi
done

scan_holders "$work/scan.a"
timed nvdra.table "$nvdra" inventory ${nvdra_args[@]+"${nvdra_args[@]}"}
t_table=$ms rc_table=$rc
timed nvdra.yaml "$nvdra" inventory ${nvdra_args[@]+"${nvdra_args[@]}"} -o yaml
t_yaml=$ms rc_yaml=$rc
timed nvdra.dyn "$nvdra" inventory ${nvdra_args[@]+"${nvdra_args[@]}"} --dynamic-mig -o yaml
t_dyn=$ms rc_dyn=$rc
timed nvdra.dyntable "$nvdra" inventory ${nvdra_args[@]+"${nvdra_args[@]}"} --dynamic-mig
scan_holders "$work/scan.b"

timed smi.q "$smi" -q
t_q=$ms rc_q=$rc
timed smi.query "$smi" --query-gpu=index,uuid,mig.mode.current,mig.mode.pending,compute_mode \
  --format=csv,noheader
t_query=$ms
for i in $selected; do
  timed "q.$i" "$smi" -q -i "$i"
  timed "lgip.$i" "$smi" mig -i "$i" -lgip
  echo "$rc $ms" >"$work/lgip.$i.rc"
  timed "lgipp.$i" "$smi" mig -i "$i" -lgipp
  echo "$rc $ms" >"$work/lgipp.$i.rc"
done
timed apps "$smi" --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader
rc_apps=$rc

probe=none
if ! command -v "$py" >/dev/null 2>&1; then
  probe="skipped, no python ($py)"
else
  timed probe "$py" "$here/nvml_probe.py" "$nvml_lib" "$repeat" "$wait_ms" \
    "$(echo "$selected" | paste -sd, -)"
  if [ "$rc" = 0 ]; then
    probe=ok
  else
    probe="failed (exit $rc): $(grep '^error' "$work/probe" | head -n 1 | cut -f2)$(first_line "$work/probe.err")"
  fi
fi
precs() { # KIND: the probe's records of KIND, without the kind
  if [ "$probe" = ok ]; then awk -F'\t' -v k="$1" -v OFS='\t' '$1 == k { $1 = ""; print substr($0, 2) }' "$work/probe"; fi
}

# nvdra's YAML as records: G uuid index minor virtualization architecture capable enabled;
# P uuid id name maxInstances multiprocessors memoryMiB; L uuid id start size; H uuid pid name
# kind. A list item ("- key: value") starts an item and is read as "key: value" one level in.
parse_nvdra() {
  awk -v OFS='\t' '
    function val(s) { sub(/^[^:]*: */, "", s); gsub(/^["\047]|["\047]$/, "", s); return s }
    function key(s) { sub(/^ */, "", s); sub(/:.*/, "", s); return s }
    function flush_gpu() { if (uuid != "") print "G", uuid, idx, minor, virt, arch, capable, enabled }
    function flush_profile() {
      if (pid != "") print "P", uuid, pid, pname, pmax, psms, int(pmem / 1048576)
      pid = ""; pname = ""; pmax = ""; psms = ""; pmem = 0
    }
    function flush_place() { if (st != "" && sz != "") print "L", uuid, pid, st, sz; st = ""; sz = "" }
    function flush_holder() { if (hpid != "") print "H", uuid, hpid, hname, hkind; hpid = ""; hname = ""; hkind = "" }
    /^- / { flush_place(); flush_profile(); flush_holder(); flush_gpu()
            uuid = idx = minor = virt = arch = capable = enabled = ""; sect = ""; sub(/^- /, "  ") }
    /^    - / && sect == "profiles" { flush_place(); flush_profile(); sub(/^    - /, "      ") }
    /^    - / && sect == "holders" { flush_holder(); sub(/^    - /, "      ") }
    /^      - / && sub_sect == "placements" { flush_place(); sub(/^      - /, "        ") }
    /^  [^ ]/ {
      k = key($0); sect = (k == "mig") ? "mig" : ""
      if (k == "index") idx = val($0); if (k == "minor") minor = val($0); if (k == "uuid") uuid = val($0)
      if (k == "architecture") arch = val($0); if (k == "virtualization") virt = val($0)
      next
    }
    /^    [^ -]/ && sect != "" {
      flush_place(); flush_profile(); flush_holder()
      k = key($0); sect = (k == "profiles" || k == "holders") ? k : "mig"
      if (k == "capable") capable = val($0); if (k == "enabled") enabled = val($0)
      next
    }
    /^      [^ -]/ && sect == "profiles" {
      k = key($0); sub_sect = (k == "placements") ? k : ""
      if (k == "name") pname = val($0); if (k == "giProfileId") pid = val($0)
      if (k == "maxInstances") pmax = val($0); if (k == "multiprocessors") psms = val($0)
      if (k == "memoryBytes") pmem = val($0)
      next
    }
    /^        [^ -]/ && sect == "profiles" && sub_sect == "placements" {
      k = key($0); if (k == "start") st = val($0); if (k == "size") sz = val($0)
    }
    /^      [^ -]/ && sect == "holders" {
      k = key($0); if (k == "pid") hpid = val($0); if (k == "name") hname = val($0)
      if (k == "kind") hkind = val($0)
    }
    END { flush_place(); flush_profile(); flush_holder(); flush_gpu() }
  ' "$1"
}
parse_nvdra "$work/nvdra.yaml" >"$work/nvdra.recs"
if [ "$rc_dyn" = 0 ]; then parse_nvdra "$work/nvdra.dyn" >"$work/nvdra.dyn.recs"; else : >"$work/nvdra.dyn.recs"; fi
nrec() { # KIND UUID: nvdra's records of KIND for the GPU, without kind and uuid
  awk -F'\t' -v k="$1" -v u="$2" -v OFS='\t' '$1 == k && $2 == u { $1 = $2 = ""; print substr($0, 3) }' "$work/nvdra.recs"
}
toggle_of() { # TABLE UUID: the MIG TOGGLE column of the GPU's row
  awk -v u="$2" 'NR == 1 { at = index($0, "MIG TOGGLE") } at && index($0, u) && /^gpu-/ {
    s = substr($0, at); sub(/ +$/, "", s); print s; exit }' "$1"
}
# smi -q facts of one GPU: virt, mig_current, mig_pending, minor, persistence, arch, product.
q_facts() {
  awk '
    !/ : / { s = $0; gsub(/^ +| +$/, "", s); if (s != "") sect = s; next }
    { k = $0; sub(/ *: .*/, "", k); gsub(/^ +/, "", k); v = substr($0, index($0, " : ") + 3); gsub(/^ +| +$/, "", v) }
    sect == "GPU Virtualization Mode" && k == "Virtualization Mode" { print "virt\t" v }
    sect == "MIG Mode" && k == "Current" { print "mig_current\t" v }
    sect == "MIG Mode" && k == "Pending" { print "mig_pending\t" v }
    k == "Minor Number" { print "minor\t" v }
    k == "Persistence Mode" { print "persistence\t" v }
    k == "Product Architecture" { print "arch\t" v }
    k == "Product Name" { print "product\t" v }
  ' "$1"
}
fact() { awk -F'\t' -v k="$2" '$1 == k { print $2; exit }' "$1"; }
smi_virt() { # nvidia-smi's words -> nvdra's
  case "$1" in
    None) echo bareMetal ;; Pass-Through) echo passthrough ;; VGPU) echo vgpuGuest ;;
    "Host VGPU") echo vgpuHost ;; "Host VSGA") echo vsgaHost ;; *) echo "unknown($1)" ;;
  esac
}
nvml_virt() { # nvmlGpuVirtualizationMode_t -> nvdra's words
  case "$1" in
    0) echo bareMetal ;; 1) echo passthrough ;; 2) echo vgpuGuest ;; 3) echo vgpuHost ;;
    4) echo vsgaHost ;; *) echo "unknown($1)" ;;
  esac
}
words() {
  case "$1" in
    bareMetal) echo "bare metal" ;; passthrough) echo "a passthrough VM" ;;
    vgpuGuest) echo "a vGPU guest" ;; vgpuHost) echo "a vGPU host" ;; vsgaHost) echo "a vSGA host" ;;
    *) echo "$1" ;;
  esac
}
simulated=false
case " ${nvdra_args[*]:-} " in
  *" --profile"* | *" --topology"* | *"--backend simulated"* | *"--backend=simulated"*) simulated=true ;;
esac

# ----------------------------------------------------------------------------------------------
say INFO setup "nvdra: $nvdra inventory ${nvdra_args[*]:-} (backend: $($simulated && echo simulated || echo as nvdra picks it)); nvidia-smi: $smi; GPUs: ${selected//$'\n'/,}"
hyper=no
if grep -qw hypervisor /proc/cpuinfo 2>/dev/null; then hyper=yes; fi
detect=$(systemd-detect-virt 2>/dev/null || true)
dmi="$(cat /sys/class/dmi/id/sys_vendor 2>/dev/null || echo '?') / $(cat /sys/class/dmi/id/product_name 2>/dev/null || echo '?')"
container=no
if [ -e /.dockerenv ] || [ -e /run/.containerenv ]; then container=yes; fi
say INFO host "kernel $(uname -r); CPU hypervisor flag: $hyper; systemd-detect-virt: ${detect:-none}; DMI: $dmi; in a container: $container (PID 1: $(cat /proc/1/comm 2>/dev/null || echo '?'))"
if [ "$rc_yaml" != 0 ]; then
  say FAIL nvdra "nvdra inventory -o yaml failed (exit $rc_yaml): $(tail -n 3 "$work/nvdra.yaml.err" | tr '\n' ' ')"
fi

# --- 1. Virtualization, and what nvdra would switch.
for i in $selected; do
  uuid=$(gpu_field "$i" 2)
  label="GPU $i ($(gpu_field "$i" 6), $uuid)"
  q_facts "$work/q.$i" >"$work/q.$i.facts"
  sv=$(fact "$work/q.$i.facts" virt)
  g=$(nrec G "$uuid")
  nv=$(echo "$g" | cut -f3 -s)
  pv=$(precs virt | awk -F'\t' -v u="$uuid" '$1 == u && $2 == "SUCCESS" { print $3 }')
  if [ -z "$g" ]; then
    say FAIL virtualization "$label: nvdra inventory lists no GPU with this UUID"
    continue
  fi
  seen="nvidia-smi -q: ${sv:-no Virtualization Mode line}; NVML: $([ -n "$pv" ] && nvml_virt "$pv" || echo 'not read'); nvdra: ${nv:-none}"
  verdict=PASS why=""
  if [ -z "$nv" ]; then
    verdict=INFO why="nvdra records no virtualization mode"
  fi
  if [ -n "$sv" ] && [ -n "$nv" ] && [ "$(smi_virt "$sv")" != "$nv" ]; then
    verdict=FAIL why="nvdra says $(words "$nv"), nvidia-smi $(words "$(smi_virt "$sv")")"
  fi
  if [ -n "$pv" ] && [ -n "$nv" ] && [ "$(nvml_virt "$pv")" != "$nv" ]; then
    verdict=FAIL why="${why:+$why; }nvdra says $(words "$nv"), NVML $(words "$(nvml_virt "$pv")")"
  fi
  if [ -z "$sv" ] && [ -z "$pv" ] && [ "$verdict" = PASS ]; then
    verdict=INFO why="nothing to compare nvdra's answer with"
  fi
  if [ "$verdict" = FAIL ]; then
    say FAIL virtualization "$label: $why ($seen)"
  else
    say "$verdict" virtualization "$label is $(words "${nv:-$(smi_virt "${sv:-?}")}")${why:+ ($why)} ($seen)"
  fi
  if [ "$hyper" = yes ] && [ "$nv" = bareMetal ]; then
    say INFO virtualization "$label: the CPU says hypervisor, the GPU says bare metal (a VM whose GPU is not virtualized as NVML sees it?)"
  fi
  toggle=$(toggle_of "$work/nvdra.table" "$uuid")
  dyn_toggle=$(toggle_of "$work/nvdra.dyntable" "$uuid")
  arch=$(echo "$g" | cut -f4)
  say INFO mig-toggle "$label: nvdra's MIG TOGGLE says \"${toggle:-?}\"$([ "$dyn_toggle" != "$toggle" ] && echo ", with --dynamic-mig \"${dyn_toggle:-?}\"") (architecture ${arch:-?}, MIG $(fact "$work/q.$i.facts" mig_current || true) → $(fact "$work/q.$i.facts" mig_pending || true))"
  if [ "$nv" = vgpuGuest ] && { [ "$toggle" = yes ] || [ "$dyn_toggle" = yes ]; }; then
    say FAIL mig-toggle "$label: nvdra would switch MIG mode on a vGPU guest"
  fi
done

# --- 2. Placements: NVML's against nvdra's tables.
# Facts: uuid TAB profile id TAB attribute TAB value, one source per file.
canon() { # "uuid id start size" lines -> "uuid id placements start:size,..."
  sort -t$'\t' -k1,1 -k2,2n -k3,3n -u | awk -F'\t' -v OFS='\t' '
    { k = $1 OFS $2; if (k != prev) { if (prev != "") print prev, "placements", s; prev = k; s = "" }
      s = s (s == "" ? "" : ",") $3 ":" $4 }
    END { if (prev != "") print prev, "placements", s }'
}
awk -F'\t' -v OFS='\t' '$1 == "L" { print $2, $3, $4, $5 }' "$work/nvdra.recs" | canon >"$work/facts.nvdra"
awk -F'\t' -v OFS='\t' '$1 == "P" { print $2, $3, "name", $4; print $2, $3, "instances", $5
  print $2, $3, "sms", $6; print $2, $3, "memory_mib", $7 }' "$work/nvdra.recs" >>"$work/facts.nvdra"
: >"$work/facts.lgip"
: >"$work/facts.lgipp"
: >"$work/facts.nvml"
for i in $selected; do
  uuid=$(gpu_field "$i" 2)
  awk -v u="$uuid" -v OFS='\t' '
    /Profile ID/ && /Placement/ {
      line = $0; sub(/.*Profile ID */, "", line); id = line; sub(/ .*/, "", id)
      sub(/[^{]*\{/, "", line); starts = line; sub(/\}.*/, "", starts); size = line; sub(/.*\}:/, "", size)
      n = split(starts, s, ","); for (j = 1; j <= n; j++) print u, id, s[j], size + 0
    }' "$work/lgipp.$i" | canon >>"$work/facts.lgipp"
  awk -v u="$uuid" -v OFS='\t' '
    /^\| +[0-9]+ +MIG / { line = $0; gsub(/\|/, " ", line); split(line, f, " +")
      n = 0; for (j = 1; j in f; j++) if (f[j] != "") g[++n] = f[j]
      # GPU, "MIG", name, id, free/total, memory GiB, P2P, SM, DEC, ENC
      split(g[5], ft, "/"); print u, g[4], "name", g[3]; print u, g[4], "instances", ft[2]
      print u, g[4], "sms", g[8] }' "$work/lgip.$i" >>"$work/facts.lgip"
done
precs place | canon >>"$work/facts.nvml"
precs profile | awk -F'\t' -v OFS='\t' '{ name = $8; sub(/^MIG_/, "", name)
  if (name != "-") print $1, $3, "name", name
  print $1, $3, "instances", $5; print $1, $3, "sms", $6; print $1, $3, "memory_mib", $7 }' >>"$work/facts.nvml"

# compare SOURCE_FACTS UUID: DIFF lines, then "S profiles placements differences".
compare() {
  awk -F'\t' -v u="$2" '
    function pretty(p,   n, a, i, starts, size, same) {
      n = split(p, a, ","); starts = ""; same = 1
      for (i = 1; i <= n; i++) { split(a[i], q, ":"); starts = starts (i > 1 ? "," : "") q[1]
        if (i == 1) size = q[2]; else if (q[2] != size) same = 0 }
      return same ? "{" starts "}:" size : p
    }
    function named(id, name) { return name == "" ? "profile " id : "profile " id " (" name ")" }
    FNR == NR { if ($1 == u) { n[$2 SUBSEP $3] = $4; nid[$2] = 1 } next }
    $1 == u { s[$2 SUBSEP $3] = $4; sid[$2] = 1 }
    END {
      for (id in sid) if (!(id in nid)) { print "D\t" named(id, s[id SUBSEP "name"]) " is NVML'"'"'s, not in nvdra'"'"'s tables"; d++ }
      for (id in nid) if (!(id in sid)) { print "D\t" named(id, n[id SUBSEP "name"]) " is in nvdra'"'"'s tables, not NVML'"'"'s"; d++ }
      for (k in s) {
        split(k, p, SUBSEP)
        if (!(p[1] in nid) || !(k in n)) continue
        if (s[k] != n[k]) {
          a = s[k]; b = n[k]; if (p[2] == "placements") { a = pretty(a); b = pretty(b) }
          print "D\t" named(p[1], n[p[1] SUBSEP "name"]) " " p[2] ": NVML " a ", nvdra " b; d++
        } else if (p[2] == "placements") { places += split(s[k], t, ",") }
      }
      for (id in sid) if (id in nid) profiles++
      print "S\t" profiles + 0 "\t" places + 0 "\t" d + 0
    }' "$work/facts.nvdra" "$1" | sort
}
for i in $selected; do
  uuid=$(gpu_field "$i" 2)
  label="GPU $i"
  mig=$(gpu_field "$i" 3)
  g=$(nrec G "$uuid")
  if [ -z "$g" ]; then continue; fi
  if [ "$(echo "$g" | cut -f5)" != true ]; then
    say INFO placements "$label: not MIG-capable by nvdra's read; nothing to compare"
    continue
  fi
  [ "$mig" = Disabled ] || say INFO placements "$label: MIG mode is $mig (the comparison is meant for MIG off; placements are the possible ones either way)"
  for src in lgip lgipp; do
    read -r src_rc src_ms <"$work/$src.$i.rc"
    if [ "$src_rc" = 0 ] && grep -q "Profile ID\|MIG " "$work/$src.$i"; then
      say INFO placements "$label: nvidia-smi mig -$src answers with MIG ${mig} ($(grep -c "Profile ID\|^| *[0-9]* *MIG " "$work/$src.$i") profiles, $src_ms ms)"
    else
      say INFO placements "$label: nvidia-smi mig -$src does not answer with MIG ${mig} (exit $src_rc: $(first_line "$work/$src.$i")$(first_line "$work/$src.$i.err"))"
    fi
  done
  compared=0
  for src in lgipp lgip nvml; do
    case $src in
      lgipp) what="nvidia-smi mig -lgipp" ;;
      lgip) what="nvidia-smi mig -lgip" ;;
      nvml) what="NVML through ctypes" ;;
    esac
    if ! awk -F'\t' -v u="$uuid" '$1 == u { found = 1 } END { exit !found }' "$work/facts.$src"; then
      continue
    fi
    compared=$((compared + 1))
    compare "$work/facts.$src" "$uuid" >"$work/cmp"
    read -r _ profiles places diffs < <(grep '^S' "$work/cmp")
    if [ "$diffs" = 0 ]; then
      say PASS placements "$label: $what and nvdra agree: $profiles profiles$([ "$src" = lgip ] || echo ", $places placements")$([ "$src" = lgipp ] || echo " (names, instances, SMs$([ "$src" = nvml ] && echo ", memory"))")"
    else
      grep '^D' "$work/cmp" | cut -f2 | while IFS= read -r d; do say DIFF placements "$label, $what: $d"; done
      say FAIL placements "$label: $what and nvdra differ ($diffs difference$([ "$diffs" = 1 ] || echo s), DIFF lines above; $profiles profiles in both)"
    fi
  done
  if [ "$compared" = 0 ]; then
    say INFO placements "$label: no NVML answer to compare nvdra's tables with (nvidia-smi lists none, NVML through ctypes: $probe)"
  fi
  bad=$(precs placerc | awk -F'\t' -v u="$uuid" '$1 == u { printf "%s%s: %s", sep, $2, $3; sep = ", " }')
  [ -z "$bad" ] || say INFO placements "$label: NVML refused the placements of profiles $bad"
done

# --- 3. Timing.
say INFO timing "nvdra inventory: $t_table ms (table), $t_yaml ms (-o yaml), $t_dyn ms (--dynamic-mig -o yaml, exit $rc_dyn)"
say INFO timing "nvidia-smi: $t_q ms (-q, all GPUs, exit $rc_q), $t_query ms (--query-gpu)"
for i in $selected; do
  read -r _ lgip_ms <"$work/lgip.$i.rc"
  read -r _ lgipp_ms <"$work/lgipp.$i.rc"
  say INFO timing "GPU $i: persistence mode $(fact "$work/q.$i.facts" persistence || true); nvidia-smi mig -lgip $lgip_ms ms, -lgipp $lgipp_ms ms"
done
if [ "$probe" = ok ]; then
  precs time | while IFS=$'\t' read -r call first median max n; do
    say INFO timing "$call: first $first ms, median $median ms, max $max ms ($n calls)"
  done
else
  say SKIP timing "NVML call timings: $probe"
fi

# --- 4. Holders.
[ "$unreadable" = 0 ] || say INFO holders "$unreadable processes' open files are unreadable (not root?): the scan misses them"
known() { # COMM EXE: what the holder is, when known
  case " $1 $2 " in
    *" nv-hostengine "*) echo "DCGM host engine: blocks a MIG switch (NVIDIA's DGX guide: stop DCGM first)" ;;
    *dcgm-exporter*) echo "dcgm-exporter (DCGM): blocks a MIG switch" ;;
    *nvidia-persiste*) echo "nvidia-persistenced: nvdra counts it harmless" ;;
    *" nvsm"*) echo "NVSM: blocks a MIG switch (NVIDIA's MIG guide: stop it first)" ;;
    *nvidia-cuda-mps*) echo "MPS control daemon or server: nvdra waits for its own to exit" ;;
    *" nvdra "*) echo "nvdra" ;;
    *" Xorg "* | *" Xwayland "*) echo "a display server" ;;
    *) echo "" ;;
  esac
}
holds() { # SCAN PID FILE: whether the scan saw PID hold FILE
  awk -F'\t' -v p="$2" -v f="$3" '$1 == p && $4 == f { n = 1 } END { exit !n }' "$1"
}
nvdra_names_holders=no
if grep -q '^H' "$work/nvdra.dyn.recs"; then nvdra_names_holders=yes; fi
blocking() { case "$1" in *"blocks a MIG switch"*) return 0 ;; *) return 1 ;; esac; }
for i in $selected; do
  uuid=$(gpu_field "$i" 2)
  minor=$(fact "$work/q.$i.facts" minor || true)
  [ -n "$minor" ] || minor=$(nrec G "$uuid" | cut -f2)
  file="$dev_root/nvidia$minor"
  held=$(awk -F'\t' -v f="$file" '$4 == f' "$work/scan.a" "$work/scan.b" | cut -f1-3 | sort -u)
  if [ -z "$held" ]; then
    say INFO holders "GPU $i: no process holds $file"
  fi
  while IFS=$'\t' read -r pid comm exe; do
    [ -n "$pid" ] || continue
    what=$(known "$comm" "$exe")
    both=no
    if holds "$work/scan.a" "$pid" "$file" && holds "$work/scan.b" "$pid" "$file"; then both=yes; fi
    say INFO holders "GPU $i: pid $pid ($comm, exe $exe) holds $file${what:+ — known: $what}$([ $both = yes ] || echo ' (in one scan only)')"
    named=$(awk -F'\t' -v u="$uuid" -v p="$pid" '$1 == "H" && $2 == u && $3 == p { print $5 }' "$work/nvdra.dyn.recs")
    if [ -n "$named" ]; then
      say PASS holders "GPU $i: nvdra --dynamic-mig names pid $pid ($named)"
    elif $simulated; then
      say INFO holders "GPU $i: nvdra's simulated backend does not name pid $pid (it reads no /proc)"
    elif [ "$both" = yes ] && blocking "$what" && [ "$nvdra_names_holders" = yes ]; then
      say FAIL holders "GPU $i: pid $pid ($comm) holds the GPU and blocks a switch, but nvdra inventory --dynamic-mig does not name it"
    elif [ "$both" = yes ] && blocking "$what"; then
      say INFO holders "GPU $i: pid $pid ($comm) blocks a switch; nvdra inventory --dynamic-mig names no holder on this node (its read may not look for them): check that nvdra run --dynamic-mig withdraws this GPU's placements"
    else
      say INFO holders "GPU $i: nvdra inventory --dynamic-mig does not name pid $pid ($comm)"
    fi
  done <<<"$held"
  awk -F'\t' -v u="$uuid" '$1 == "H" && $2 == u' "$work/nvdra.dyn.recs" | while IFS=$'\t' read -r _ _ pid name kind; do
    awk -F'\t' -v p="$pid" '$1 == p { f = 1 } END { exit !f }' <<<"$held" || say INFO holders "GPU $i: nvdra names pid $pid (${name:-?}, $kind), which holds no $file here"
  done
  if [ "$rc_apps" = 0 ]; then
    apps=$(awk -F', ' -v u="$uuid" '$1 == u' "$work/apps")
    [ -n "$apps" ] || say INFO holders "GPU $i: nvidia-smi lists no compute process"
    while IFS= read -r line; do
      [ -z "$line" ] || say INFO holders "GPU $i: NVML compute process (nvidia-smi): ${line#"$uuid, "}"
    done <<<"$apps"
  else
    say INFO holders "GPU $i: nvidia-smi --query-compute-apps failed (exit $rc_apps): $(first_line "$work/apps")"
  fi
  precs proc | awk -F'\t' -v u="$uuid" '$1 == u' | while IFS=$'\t' read -r _ pid used gi ci; do
    mib=$(awk -v b="$used" 'BEGIN { if (b >= 2^62) print "n/a"; else printf "%d", b / 1048576 }')
    say INFO holders "GPU $i: NVML compute process (ctypes): pid $pid ($(cat "/proc/$pid/comm" 2>/dev/null || echo 'not in this PID namespace')), $mib MiB, GPU instance $gi, compute instance $ci"
  done
done
others=$(awk -F'\t' '$4 !~ /nvidia[0-9]+$/ { print $1 " (" $2 "): " $4 }' "$work/scan.a" "$work/scan.b" | sort -u | paste -sd';' - | sed 's/;/; /g')
[ -z "$others" ] || say INFO holders "node-wide device files held: $others"
[ "$container" = no ] || say INFO holders "in a container: processes outside its PID namespace are not seen"

# --- 5. Events.
for i in $selected; do
  uuid=$(gpu_field "$i" 2)
  if [ "$probe" != ok ]; then
    say SKIP events "GPU $i: NVML through ctypes: $probe"
    continue
  fi
  ev=$(precs event | awk -F'\t' -v u="$uuid" '$1 == u')
  if [ -z "$ev" ]; then
    say FAIL events "GPU $i: the probe did not reach this GPU ($(grep '^error' "$work/probe" | head -n 1 | cut -f2))"
    continue
  fi
  IFS=$'\t' read -r _ sup_rc mask reg_rc wait_rc waited free_rc detail <<<"$ev"
  seen="supported types $mask ($sup_rc), register XID: $reg_rc, wait ${wait_ms} ms: $wait_rc after $waited ms, free: $free_rc${detail:+, $detail}"
  case "$reg_rc/$wait_rc/$free_rc" in
    SUCCESS/TIMEOUT/SUCCESS) say PASS events "GPU $i: critical-XID registration works, no event in ${wait_ms} ms ($seen)" ;;
    SUCCESS/SUCCESS/SUCCESS) say PASS events "GPU $i: registration works and an event arrived ($seen)" ;;
    NOT_SUPPORTED/*) say INFO events "GPU $i: no XID events here (nvdra leaves the GPU unmonitored): $seen" ;;
    *) say FAIL events "GPU $i: $seen" ;;
  esac
done

# --- Settings: as they were.
settings "$work/gpus.after"
for i in $selected; do
  before=$(awk -F'\t' -v i="$i" '$1 == i { print "MIG " $3 " (pending " $4 "), compute mode " $5 }' "$work/gpus.before")
  after=$(awk -F'\t' -v i="$i" '$1 == i { print "MIG " $3 " (pending " $4 "), compute mode " $5 }' "$work/gpus.after")
  if [ "$before" = "$after" ]; then
    say PASS settings "GPU $i: unchanged: $after"
  else
    say FAIL settings "GPU $i: changed while this ran (not by this check, which sets nothing): before $before, after ${after:-unreadable}"
  fi
done

# --- 6. What needs a machine where switching MIG mode is allowed (README: the same list).
while IFS= read -r line; do say NEXT needs-switch "$line"; done <<'EOF'
toggle time on Hopper: nvmlDeviceSetMigMode on and off on an idle GPU (wall time, activation status; with and without persistence mode), and creating the first instance right after
pending mode and RESET_REQUIRED: a switch asked while a CUDA context holds the GPU (IN_USE, a pending mode left?), whether one more request back to the current mode clears it without a reset, and what a passthrough VM answers (in place on Hopper, or RESET_REQUIRED)
IN_USE with DCGM running: nv-hostengine or dcgm-exporter started, a switch asked: IN_USE, and which processes NVML names (none are compute processes); whether nvidia-persistenced alone blocks it
minors across a switch: nvmlDeviceGetMinorNumber, /dev/nvidia<minor>, the PCI bus id and the UUID before and after turning MIG on and off (NVML's documentation says the minor may change)
per-instance XID event ids: an XID raised inside one MIG instance: the event's gpuInstanceId and computeInstanceId, on the GPU's registration and on a MIG device handle's, and which XIDs stay GPU-wide
nvdra's own MPS server after the last share: how long until it releases /dev/nvidia<minor> and a switch passes
EOF

if [ "$fails" -gt 0 ]; then
  echo "mig-readonly: $fails check(s) failed; report in $report"
  exit 1
fi
echo "mig-readonly: no check failed; report in $report"
