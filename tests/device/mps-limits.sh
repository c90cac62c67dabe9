#!/usr/bin/env bash
# Device check for issue 24: which form of CUDA_MPS_PINNED_DEVICE_MEM_LIMIT does CUDA apply, what
# does CUDA_MPS_ACTIVE_THREAD_PERCENTAGE do to the SM count a client sees, and how much device
# memory the MPS server itself takes. Run on a real GPU node (the device tool's machine), as root:
#
#   bash tests/device/mps-limits.sh        # results on stdout and in $OUT/mps-limits.json
#
# It starts one MPS control daemon for GPU 0 in a private pipe directory, runs the CUDA client
# (tests/device/mps_client.py: the CUDA runtime of NVIDIA's PyPI wheel through ctypes) under each
# key form, and stops the daemon. It never changes MIG mode or the compute mode, never resets the
# GPU, and checks both are as they were at the end. Every step has a deadline; the whole run takes
# well under 10 minutes.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp}/mps-limits.json
limit_mib=${LIMIT_MIB:-2048}
cap_mib=$((limit_mib * 3))

find_bin() {
  for d in $(echo "$PATH" | tr : ' ') /usr/local/nvidia/bin /usr/bin /usr/local/bin /bin; do
    [ -x "$d/$1" ] && { echo "$d/$1"; return 0; }
  done
  return 1
}
smi=$(find_bin nvidia-smi) || { echo "no nvidia-smi: not a GPU node"; exit 2; }
control=$(find_bin nvidia-cuda-mps-control) || { echo "no nvidia-cuda-mps-control: the driver's MPS tools are not installed"; exit 2; }
py=$(command -v python3)

query() { timeout 20 "$smi" -i 0 --query-gpu="$1" --format=csv,noheader,nounits | tr -d ' '; }
uuid=$(query uuid)
mig_before=$(query mig.mode.current)
mode_before=$(query compute_mode)
total_mib=$(query memory.total)
echo "GPU 0: $uuid, $total_mib MiB, MIG mode $mig_before, compute mode $mode_before, driver $(query driver_version)"

dir=$(mktemp -d /tmp/mpschk.XXXX)
export CUDA_MPS_PIPE_DIRECTORY=$dir/pipe CUDA_MPS_LOG_DIRECTORY=$dir/log CUDA_VISIBLE_DEVICES=$uuid
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
ask() { echo "$1" | timeout 10 "$control"; }
cleanup() {
  ask quit >/dev/null 2>&1 || pkill -9 -f nvidia-cuda-mps >/dev/null 2>&1
  rm -rf "$dir"
}
trap cleanup EXIT

used_before=$(query memory.used)
timeout 20 "$control" -d || { echo "the MPS control daemon did not start"; exit 1; }
for _ in $(seq 1 50); do ask get_server_list >/dev/null 2>&1 && break; sleep 0.2; done
ask get_server_list >/dev/null 2>&1 || { echo "the MPS control daemon does not answer"; cat "$CUDA_MPS_LOG_DIRECTORY"/control.log; exit 1; }
echo "MPS control daemon answers (pipe $CUDA_MPS_PIPE_DIRECTORY)"

client() { # label, env assignments...
  local label=$1; shift
  local line
  line=$(env "$@" timeout 120 "$py" "$here/mps_client.py" "$cap_mib" 128 2>&1 | tail -n 1)
  echo "  $label: $line" >&2
  printf '"%s": %s' "$label" "${line:-null}"
}

{
  echo "{"
  echo "\"gpu\": \"$uuid\", \"total_mib\": $total_mib, \"limit_mib\": $limit_mib, \"cap_mib\": $cap_mib,"
  echo "\"cases\": {"
  client no-limit; echo ","
  client uuid-key "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=$uuid=${limit_mib}M"; echo ","
  client index-key "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=${limit_mib}M"; echo ","
  client index-key-gib "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=$((limit_mib / 1024))G"; echo ","
  client threads-25 "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"
  echo "},"
  # What the MPS server takes: the GPU's used memory while one client holds a small allocation,
  # against the same before the daemon started.
  HOLD_SECONDS=8 timeout 60 "$py" "$here/mps_client.py" 128 128 >"$dir/hold.out" 2>&1 &
  holder=$!
  used_with=null
  for _ in $(seq 1 40); do
    grep -q holding "$dir/hold.out" 2>/dev/null && { used_with=$(query memory.used); break; }
    kill -0 "$holder" 2>/dev/null || break  # it ended without allocating
    sleep 0.25
  done
  apps=$(timeout 20 "$smi" -i 0 --query-compute-apps=pid,process_name,used_memory --format=csv,noheader | tr '\n' ';')
  wait "$holder"
  echo "\"used_mib_before_daemon\": $used_before, \"used_mib_with_one_128mib_client\": $used_with,"
  echo "\"compute_apps\": \"${apps//\"/}\","
  echo "\"servers\": \"$(ask get_server_list | tr '\n' ' ')\""
  echo "}"
} >"$out"

ask quit >/dev/null 2>&1 || echo "quit did not answer in 10 s"
mig_after=$(query mig.mode.current)
mode_after=$(query compute_mode)
echo "after: MIG mode $mig_after, compute mode $mode_after"
[ "$mig_after" = "$mig_before" ] && [ "$mode_after" = "$mode_before" ] || { echo "GPU settings changed!"; exit 1; }
cat "$out"
"$py" - "$out" "$limit_mib" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); limit = int(sys.argv[2])
for k, v in r["cases"].items():
    if not isinstance(v, dict) or "allocated_mib" not in v:
        print(f"{k}: no result ({v})"); continue
    applied = v["allocated_mib"] <= limit
    print(f"{k}: allocated {v['allocated_mib']} MiB of a {r['cap_mib']} MiB cap, "
          f"{'limit APPLIED' if applied else 'no limit'}; multiprocessors {v.get('multiprocessors')}")
held = r["used_mib_with_one_128mib_client"]
if held is None:
    print("MPS server + one client context: not measured (the holding client did not allocate)")
else:
    print(f"MPS server + one client context: {held - r['used_mib_before_daemon'] - 128} MiB beyond the 128 MiB allocated")
PY
