#!/usr/bin/env bash
# Device check (issues 24 and 32): what only a GPU can tell about MPS as nvdra runs it. Run it on
# a GPU node (the device tool's machine), as root:
#
#   bash tests/device/mps-limits.sh        # a summary on stdout, the report in $OUT/mps-limits.json
#
# It is safe on a node whose GPUs others use:
# - It stops only what it started. Each MPS control daemon runs in the foreground (`-f`, as the
#   MPS host runs it) as a child of this script, with pipe and log directories of its own under a
#   fresh /tmp/mpschk.* directory; the PIDs (with their start times) of every daemon and client
#   it starts are recorded, and at the end of each case, and on exit, it asks its daemons to quit
#   and then SIGKILLs those PIDs and their descendants (/proc/<pid>/task/*/children), each only
#   while its PID is still the process it started. It never signals a process by name, and no
#   client of it talks to a daemon of the node's.
# - It never changes MIG mode, the compute mode or any other GPU setting, never resets a GPU, and
#   checks at the end that MIG mode and the compute mode are as they were (exit 1 otherwise). On
#   a GPU in MIG mode it stops at once: exit 0, report {"skipped": "MIG enabled"}.
# - The memory-limits case sets limits only on a scratch cgroup of its own, clears them and
#   removes the cgroup.
#
# The cases run one after the other, each under its own deadline, and each writes its result, or
# "not_measured" with the reason, under "checks" in the report:
#   host-start        the daemon as the MPS host starts it (-f, CUDA_VISIBLE_DEVICES, pipe and log
#                     directories; -M only when `nvidia-cuda-mps-control -h` lists it, the help's
#                     -M line recorded), and a client: does it connect
#   key-forms         which form of CUDA_MPS_PINNED_DEVICE_MEM_LIMIT CUDA applies (UUID key, index
#                     key, G suffix), and what CUDA_MPS_ACTIVE_THREAD_PERCENTAGE does to the SMs
#   pid-namespace     the same daemon inside a PID namespace of its own (unshare -p -f
#                     --mount-proc), as the MPS host without hostPID: does a client outside
#                     connect, and what do the daemon's logs say of it (a client PID 0?)
#   uid-1000          a client as uid 1000 (setpriv), then one as root beside it (-M or waiting)
#   concurrent        1, 2 and 4 clients at once: the GPU's used memory before and with them, so
#                     what MPS itself takes (server, per-client contexts)
#   default-limit     set_default_device_pinned_mem_limit against a client asking more: which wins
#   sigkill-restart   the daemon SIGKILLed, then a new one over the same (stale) directories
#   quit-as-uid-1000  `quit` sent by uid 1000: does the daemon obey
#   memory-limits     only with driver >= 615 and cgroup v2: a scratch cgroup's soft and hard limits
#                     set through `nvidia-smi memory-limits`, read back, a client past the hard
#                     limit and one under it (and one past it reaching no daemon), the limits
#                     cleared, the cgroup removed
# A client is tests/device/mps_client.py (CUDA's runtime through ctypes). "connected" says whether
# it went through the daemon: the stand-in client says so itself; for CUDA the daemon's logs (a
# new client) or a new server are the evidence, and a client that allocated without either is
# taken for a plain context (or for logs this check cannot read: their new lines are in the
# report).
#
# Settings (environment): OUT (where the report goes; /tmp), LIMIT_MIB (2048), HOLD_SECONDS (4:
# how long a client holds its memory while it is measured), CASES (the cases to run, by name;
# all), DEADLINES (e.g. "concurrent=120,key-forms=90": other deadlines than the defaults),
# MPS_CHECK_CLIENT (a program run instead of python3 mps_client.py, taking its arguments and
# printing its lines; the stand-in test passes one), CGROUP_ROOT (/sys/fs/cgroup). The default
# deadlines add up to 7 minutes; a run whose cases all answer should take about 3 (not yet timed
# on a GPU). Exit 0 when it ran (whatever it measured), 1 when a GPU setting changed, 2 when this
# is not a GPU node with MPS or a setting is malformed.
#
# tests/integration/device_check.rs runs it here end to end on stand-ins (a fake nvidia-smi, the MPS
# stand-in, a cgroup directory, no CUDA), so the one run a lent GPU allows is not spent on a broken
# script.
set -uo pipefail

# ---------------------------------------------------------------------------------------------
# Helpers, shared by the main process and each case's process.

find_bin() {
  local d
  for d in $(echo "$PATH" | tr : ' ') /usr/local/nvidia/bin /usr/bin /usr/local/bin /bin; do
    [ -x "$d/$1" ] && { echo "$d/$1"; return 0; }
  done
  return 1
}

query() { timeout 10 "$smi" -i 0 --query-gpu="$1" --format=csv,noheader,nounits 2>/dev/null | tr -d ' '; }
compute_apps() {
  timeout 10 "$smi" -i 0 --query-compute-apps=pid,process_name,used_memory --format=csv,noheader \
    2>/dev/null | tr '\n' ';'
}

# The report: note CHECK KEY VALUE (a string), notej CHECK KEY JSON; CHECK "." is the top level.
note() { "$py" "$dir/h.py" note "$report" "$1" "$2" str "$3"; }
notej() { "$py" "$dir/h.py" note "$report" "$1" "$2" json "$3"; }

# --- Processes: only those this check started, each known by its PID and start time.

stat_fields() { # PID: the fields of /proc/PID/stat after the command name
  local s
  s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  echo "${s##*) }"
}
start_time() { local f a; f=$(stat_fields "$1") || return 1; read -r -a a <<<"$f"; echo "${a[19]}"; }
alive() { local f; f=$(stat_fields "$1") || return 1; [ "${f%% *}" != Z ]; }
ours() { [ -n "${2:-}" ] && [ "$(start_time "$1" 2>/dev/null)" = "$2" ]; }
children() { # PID: its children
  if [ -d "/proc/$1/task" ]; then
    cat /proc/"$1"/task/*/children 2>/dev/null || pgrep -P "$1"
  fi
}
track() { # PID...: processes this check started (and may stop)
  local p t
  for p; do t=$(start_time "$p") && echo "$p $t" >>"$dir/pids"; done
}
tracked_start() { grep "^$1 " "$dir/pids" 2>/dev/null | tail -n 1 | cut -d' ' -f2; }
stop_and_list() { # PID: SIGSTOP it, then each descendant in turn (none can fork then); prints them
  local c
  kill -STOP "$1" 2>/dev/null || return 0
  echo "$1"
  for c in $(children "$1"); do stop_and_list "$c"; done
}
stop_tree() { # PID START: SIGKILL the process started as PID, and its descendants, if PID is still it
  local pid=$1 start=$2 all
  ours "$pid" "$start" || return 0
  kill -STOP "$pid" 2>/dev/null || return 0
  # PID was ours a moment ago; if it was reused since, let the new process go on.
  ours "$pid" "$start" || { kill -CONT "$pid" 2>/dev/null; return 0; }
  all=$(stop_and_list "$pid")
  # shellcheck disable=SC2086
  kill -KILL $all 2>/dev/null
  return 0
}
stop_tracked() { # every process this check started that still runs
  local pid start
  [ -f "$dir/pids" ] || return 0
  while read -r pid start; do stop_tree "$pid" "$start"; done <"$dir/pids"
}

# --- Daemons: NAME's directories are $dir/NAME/{pipe,log}.

ask() { # NAME COMMAND: COMMAND to NAME's daemon, with a deadline; its answer (stdout)
  echo "$2" | CUDA_MPS_PIPE_DIRECTORY=$dir/$1/pipe timeout 10 "$control" 2>/dev/null
}
ask_all() { # NAME COMMAND: the same, stderr too, and the exit status in a last line
  local out rc
  out=$(echo "$2" | CUDA_MPS_PIPE_DIRECTORY=$dir/$1/pipe timeout 10 "$control" 2>&1)
  rc=$?
  printf '%s\n(exit %s)' "$out" "$rc"
}
answers() { ask "$1" get_server_list >/dev/null; }

start_daemon() { # NAME [WRAPPER...]: NAME's daemon as the MPS host starts it; sets daemon_pid
  # (WRAPPER's when given); fails when it does not answer get_server_list within 10 s.
  local name=$1 i
  shift
  # Modes as the MPS host makes them (src/mps/dir.rs): the pipe directory open to every UID.
  mkdir -p "$dir/$name/pipe" "$dir/$name/log"
  chmod 0777 "$dir/$name/pipe"
  chmod 0700 "$dir/$name/log"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$uuid CUDA_MPS_PIPE_DIRECTORY=$dir/$name/pipe \
    CUDA_MPS_LOG_DIRECTORY=$dir/$name/log \
    "$@" "$control" -f $multi >>"$dir/$name/log/daemon.out" 2>&1 </dev/null &
  daemon_pid=$!
  track "$daemon_pid"
  for i in $(seq 1 50); do
    answers "$name" && return 0
    alive "$daemon_pid" || return 1
    sleep 0.2
  done
  return 1
}

quit_daemon() { # NAME CHECK: quit NAME's daemon (daemon_pid), SIGKILL it and what it started after 10 s
  local name=$1 check=$2 i start
  start=$(start_time "$daemon_pid") || return 0
  ask "$name" quit >/dev/null 2>&1
  for i in $(seq 1 40); do alive "$daemon_pid" || break; sleep 0.25; done
  if alive "$daemon_pid"; then
    note "$check" quit "not obeyed within 10 s: SIGKILLed"
  fi
  stop_tree "$daemon_pid" "$start"
}

log_lines() { { wc -l <"$dir/$1/log/$2"; } 2>/dev/null || echo 0; }
record_logs() { # CHECK NAME: the last lines of NAME's logs
  local f
  for f in control.log server.log daemon.out; do
    [ -f "$dir/$2/log/$f" ] && note "$1" "log_${f//./_}" "$(tail -n 20 "$dir/$2/log/$f")"
  done
  return 0
}

# --- Clients. A client of NAME's daemon runs as ${prefix[@]} ${client[@]} CAP CHUNK, holds what
# it allocated for HOLD_SECONDS, and prints JSON lines (one with "holding" while it holds).

declare -A c_out c_pid c_name c_ctl c_srv c_dout c_servers c_servers_held c_t0 c_held c_used \
  c_apps c_waited c_as
prefix=()
# Whether a client that holds is also measured on the GPU (nvidia-smi takes a second or two).
sample_gpu=true

client_begin() { # LABEL NAME CAP CHUNK [VAR=VALUE...]
  local label=$1 name=$2 cap=$3 chunk=$4
  shift 4
  c_out[$label]=$dir/$name/client-$label.out
  c_name[$label]=$name
  c_ctl[$label]=$(log_lines "$name" control.log)
  c_srv[$label]=$(log_lines "$name" server.log)
  c_dout[$label]=$(log_lines "$name" daemon.out)
  c_servers[$label]=$(ask "$name" get_server_list | tr '\n' ' ')
  c_held[$label]=false
  c_used[$label]=null
  c_apps[$label]=""
  c_as[$label]=${prefix[*]:-root}
  c_t0[$label]=$SECONDS
  env CUDA_VISIBLE_DEVICES="$uuid" CUDA_MPS_PIPE_DIRECTORY="$dir/$name/pipe" \
    CUDA_MPS_LOG_DIRECTORY="$dir/$name/log" HOLD_SECONDS="$hold" "$@" \
    timeout -k 2 "$client_deadline" ${prefix[@]+"${prefix[@]}"} "${client[@]}" "$cap" "$chunk" \
    >"${c_out[$label]}" 2>&1 </dev/null &
  c_pid[$label]=$!
  track "${c_pid[$label]}"
}

client_wait_held() { # LABEL SECONDS: until it holds (then samples the daemon and the GPU) or ends
  local label=$1 i pid=${c_pid[$1]}
  for ((i = 0; i < $2 * 4; i++)); do
    if grep -q '"holding"' "${c_out[$label]}" 2>/dev/null; then
      c_held[$label]=true
      c_servers_held[$label]=$(ask "${c_name[$label]}" get_server_list | tr '\n' ' ')
      if $sample_gpu; then
        c_used[$label]=$(query memory.used)
        c_apps[$label]=$(compute_apps)
      fi
      c_waited[$label]=$((SECONDS - c_t0[$label]))
      return 0
    fi
    alive "$pid" || return 1
    sleep 0.25
  done
  return 1
}
client_end() { # CHECK LABEL: waits for it to exit, then records it under CHECK.LABEL
  local check=$1 label=$2 name=${c_name[$2]}
  wait "${c_pid[$label]}" 2>/dev/null
  tail -n +"$((c_ctl[$label] + 1))" "$dir/$name/log/control.log" >"${c_out[$label]}.ctl" 2>/dev/null
  tail -n +"$((c_srv[$label] + 1))" "$dir/$name/log/server.log" >"${c_out[$label]}.srv" 2>/dev/null
  tail -n +"$((c_dout[$label] + 1))" "$dir/$name/log/daemon.out" >"${c_out[$label]}.dout" 2>/dev/null
  "$py" "$dir/h.py" client "$report" "$check" "$label" "${c_out[$label]}" \
    held="${c_held[$label]}" servers_before="${c_servers[$label]}" \
    servers_while_held="${c_servers_held[$label]:-}" used_mib_while_held="${c_used[$label]}" \
    compute_apps="${c_apps[$label]}" waited_s="${c_waited[$label]:-null}" as="${c_as[$label]}"
}

client_case() { # CHECK LABEL NAME CAP CHUNK [VAR=VALUE...]: one client, start to end
  local check=$1 label=$2
  shift 2
  client_begin "$label" "$@"
  client_wait_held "$label" "$client_deadline"
  client_end "$check" "$label"
}

# The program a client of uid 1000 runs: the check's, or mps_client.py under a Python uid 1000
# can run (root's own may live under /root); fails when there is none.
client_for_uid_1000() {
  local p
  if [ -n "${MPS_CHECK_CLIENT:-}" ]; then
    "${as_1000[@]}" test -x "$MPS_CHECK_CLIENT" || return 1
    client=("$MPS_CHECK_CLIENT")
    return 0
  fi
  mkdir -p "$dir/bin" && cp "$here/mps_client.py" "$dir/bin/" && chmod -R a+rX "$dir/bin"
  for p in "$py" /usr/bin/python3 /usr/local/bin/python3; do
    if "${as_1000[@]}" "$p" -c pass 2>/dev/null; then
      client=("$p" "$dir/bin/mps_client.py")
      return 0
    fi
  done
  return 1
}

# ---------------------------------------------------------------------------------------------
# The cases. Each runs in a process of its own under its deadline (see the main part).

case_host_start() {
  local c=host-start
  note $c daemon "$control -f $multi with CUDA_VISIBLE_DEVICES=$uuid, CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY, as the MPS host starts it"
  if ! start_daemon host; then
    note $c not_measured "the daemon did not answer get_server_list within 10 s"
    record_logs $c host
    return
  fi
  notej $c answered true
  client_case $c client host 128 128
  record_logs $c host
  quit_daemon host $c
}

case_key_forms() {
  local c=key-forms
  if ! start_daemon keys; then
    note $c not_measured "the daemon did not answer get_server_list within 10 s"
    record_logs $c keys
    return
  fi
  sample_gpu=false
  client_case $c no-limit keys "$cap_mib" 128
  client_case $c uuid-key keys "$cap_mib" 128 "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=$uuid=${limit_mib}M"
  client_case $c index-key keys "$cap_mib" 128 "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=${limit_mib}M"
  client_case $c index-key-gib keys "$cap_mib" 128 \
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=$((limit_mib / 1024))G"
  client_case $c threads-25 keys 128 128 "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"
  record_logs $c keys
  quit_daemon keys $c
}

case_pid_namespace() {
  local c=pid-namespace err
  # A shell as the namespace's PID 1 and the daemon its child, as in a pod without hostPID
  # (where nvdra mps-host is PID 1). When the daemon quits, the shell and the namespace end.
  local ns=(unshare -p -f --mount-proc sh -c '"$@" & wait' sh)
  if ! err=$(unshare -p -f --mount-proc true 2>&1); then
    note $c not_measured "unshare -p -f --mount-proc fails here: $err"
    return
  fi
  note $c daemon "${ns[*]} $control -f $multi"
  if ! start_daemon pidns "${ns[@]}"; then
    note $c not_measured "the daemon in its own PID namespace did not answer get_server_list within 10 s"
    record_logs $c pidns
    return
  fi
  notej $c answered true
  # Server PIDs the daemon lists are its namespace's, not ours: recorded, never signalled.
  client_case $c client pidns 128 128
  record_logs $c pidns
  quit_daemon pidns $c
}

as_1000=(setpriv --reuid 1000 --regid 1000 --clear-groups)

case_uid_1000() {
  local c=uid-1000 err root_client=("${client[@]}")
  if ! err=$("${as_1000[@]}" true 2>&1); then
    note $c not_measured "cannot run a process as uid 1000 (${as_1000[*]}): $err"
    return
  fi
  if ! client_for_uid_1000; then
    note $c not_measured "uid 1000 can run no client here (no Python it may run)"
    return
  fi
  note $c client_program "${client[*]}"
  if ! start_daemon u1000; then
    note $c not_measured "the daemon did not answer get_server_list within 10 s"
    record_logs $c u1000
    return
  fi
  # uid 1000's client holds three times as long, so that root's starts while it holds: with -M
  # both connect; single-user MPS makes root's wait until uid 1000's exits.
  prefix=("${as_1000[@]}")
  client_begin uid-1000 u1000 128 128 "HOLD_SECONDS=$((hold * 3))"
  client_wait_held uid-1000 "$client_deadline"
  prefix=()
  client=("${root_client[@]}")
  client_begin root-beside u1000 128 128
  client_wait_held root-beside "$((hold * 2))"
  client_end $c uid-1000
  client_end $c root-beside
  record_logs $c u1000
  quit_daemon u1000 $c
}

case_concurrent() {
  local c=concurrent n i
  notej $c used_mib_before_daemon "$(query memory.used)"
  if ! start_daemon conc; then
    note $c not_measured "the daemon did not answer get_server_list within 10 s"
    record_logs $c conc
    return
  fi
  notej $c used_mib_with_daemon "$(query memory.used)"
  sample_gpu=false
  for n in 1 2 4; do
    notej $c "used_mib_before_$n" "$(query memory.used)"
    # Each holds long enough for all to be holding at once.
    for ((i = 1; i <= n; i++)); do client_begin "$n-$i" conc 128 128 "HOLD_SECONDS=$((hold * 2))"; done
    for ((i = 1; i <= n; i++)); do client_wait_held "$n-$i" "$client_deadline"; done
    notej $c "used_mib_with_$n" "$(query memory.used)"
    note $c "compute_apps_with_$n" "$(compute_apps)"
    note $c "servers_with_$n" "$(ask conc get_server_list | tr '\n' ' ')"
    for ((i = 1; i <= n; i++)); do client_end $c "$n-$i"; done
    notej $c "used_mib_after_$n" "$(query memory.used)"
  done
  record_logs $c conc
  quit_daemon conc $c
}

case_default_limit() {
  local c=default-limit
  if ! start_daemon deflim; then
    note $c not_measured "the daemon did not answer get_server_list within 10 s"
    record_logs $c deflim
    return
  fi
  note $c set_answer "$(ask_all deflim "set_default_device_pinned_mem_limit 0 ${limit_mib}M")"
  note $c get_answer "$(ask_all deflim "get_default_device_pinned_mem_limit 0")"
  notej $c default_mib "$limit_mib"
  notej $c client_mib "$((limit_mib * 2))"
  client_case $c client-asks-more deflim "$cap_mib" 128 \
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=$((limit_mib * 2))M"
  client_case $c client-asks-nothing deflim "$cap_mib" 128
  record_logs $c deflim
  quit_daemon deflim $c
}

case_sigkill_restart() {
  local c=sigkill-restart first kids k start outlived="" i
  if ! start_daemon restart; then
    note $c not_measured "the daemon did not answer get_server_list within 10 s"
    record_logs $c restart
    return
  fi
  first=$daemon_pid
  start=$(tracked_start "$first")
  client_case $c before-kill restart 128 128
  if ! ours "$first" "$start"; then
    note $c not_measured "the daemon had exited before it could be killed: $(tail -n 5 "$dir/restart/log/daemon.out" 2>&1)"
    record_logs $c restart
    return
  fi
  # What the daemon started (its servers) is ours too: listed (each stopped for the moment it
  # is listed, so none forks meanwhile) and tracked before the daemon goes.
  kids=$(stop_and_list "$first" | tail -n +2)
  # shellcheck disable=SC2086
  kill -CONT "$first" $kids 2>/dev/null
  # shellcheck disable=SC2086
  track $kids
  kill -KILL "$first"
  wait "$first" 2>/dev/null
  sleep 1
  for k in $kids; do alive "$k" && outlived="$outlived $k"; done
  note $c daemon_children "${kids//$'\n'/ }"
  note $c children_alive_1s_after_sigkill "${outlived# }"
  note $c stale_files "$(ls -la "$dir/restart/pipe" 2>&1)"
  for k in $kids; do stop_tree "$k" "$(tracked_start "$k")"; done
  i=$SECONDS
  if start_daemon restart; then
    notej $c restarted true
    notej $c restart_answered_after_s "$((SECONDS - i))"
    client_case $c after-restart restart 128 128
  else
    notej $c restarted false
    note $c not_measured "a new daemon over the stale directories did not answer within 10 s"
  fi
  record_logs $c restart
  quit_daemon restart $c
}

case_quit_as_uid_1000() {
  local c=quit-as-uid-1000 err i obeyed=false
  if ! err=$("${as_1000[@]}" true 2>&1); then
    note $c not_measured "cannot run a process as uid 1000 (${as_1000[*]}): $err"
    return
  fi
  if ! start_daemon q1000; then
    note $c not_measured "the daemon did not answer get_server_list within 10 s"
    record_logs $c q1000
    return
  fi
  note $c answer "$(echo quit | CUDA_MPS_PIPE_DIRECTORY=$dir/q1000/pipe timeout 10 "${as_1000[@]}" "$control" 2>&1; echo "(exit $?)")"
  for i in $(seq 1 20); do alive "$daemon_pid" || break; sleep 0.25; done
  alive "$daemon_pid" || obeyed=true
  notej $c obeyed "$obeyed"
  if ! $obeyed; then
    if answers q1000; then notej $c still_answers true; else notej $c still_answers false; fi
  fi
  record_logs $c q1000
  quit_daemon q1000 $c
}

case_memory_limits() {
  local c=memory-limits major fs v2=false cg soft hard out rc
  major=${driver%%.*}
  fs=$(stat -fc %T "$cgroup_root" 2>/dev/null || echo missing)
  [ -f "$cgroup_root/cgroup.controllers" ] && v2=true
  notej $c cgroup_v2 "$v2"
  note $c cgroup_fs "$fs"
  if ! [ "$major" -ge 615 ] 2>/dev/null || ! $v2; then
    note $c not_measured "driver $driver / cgroup $fs at $cgroup_root (needs driver 615 or newer and cgroup v2)"
    return
  fi
  note $c cgroup_root_controllers "$(cat "$cgroup_root/cgroup.controllers" 2>&1)"
  note $c dmem_capacity "$(cat "$cgroup_root/dmem.capacity" 2>&1)"
  note $c smi_help "$(timeout 10 "$smi" memory-limits -h 2>&1 | head -n 40)"
  cg=$cgroup_root/nvdra-devcheck-$$
  if ! out=$(mkdir "$cg" 2>&1); then
    note $c not_measured "cannot create the scratch cgroup $cg: $out"
    return
  fi
  echo "$cg" >>"$dir/cgroups"
  note $c cgroup "$cg"
  soft=$((limit_mib / 2))
  hard=$limit_mib
  notej $c soft_mib "$soft"
  notej $c hard_mib "$hard"
  out=$(timeout 20 "$smi" memory-limits --set -n "$cg" --soft-limit "$soft" --hard-limit "$hard" -i 0 2>&1)
  rc=$?
  note $c set "$out (exit $rc)"
  notej $c set_ok "$([ $rc = 0 ] && echo true || echo false)"
  read_limits $c read_back "$cg"
  if [ $rc = 0 ] && start_daemon cgroup; then
    # Each client moves itself into the scratch cgroup before it starts (as a share's container
    # is in its own cgroup), then runs through the daemon as a share's would.
    # shellcheck disable=SC2016
    prefix=(sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$cg")
    client_case $c past-hard cgroup $((hard * 2)) 128
    client_case $c under-hard cgroup $((hard / 2)) 128
    # And one that reaches no daemon (a plain context): do the limits need MPS at all?
    mkdir -p "$dir/no-daemon"
    client_case $c past-hard-without-mps cgroup $((hard * 2)) 128 \
      "CUDA_MPS_PIPE_DIRECTORY=$dir/no-daemon"
    prefix=()
    record_logs $c cgroup
    quit_daemon cgroup $c
  elif [ $rc = 0 ]; then
    note $c not_measured "the daemon did not answer get_server_list within 10 s"
  else
    note $c not_measured "nvidia-smi memory-limits --set failed (exit $rc)"
  fi
  clear_limits $c "$cg"
  read_limits $c read_back_after_clear "$cg"
  if out=$(rmdir "$cg" 2>&1); then notej $c cgroup_removed true; else note $c cgroup_removed "no: $out"; fi
}

clear_limits() { # CHECK CGROUP: soft 0 and hard "max" (NVML's no-limit), else hard = the GPU's memory
  local out rc
  out=$(timeout 20 "$smi" memory-limits --set -n "$2" --soft-limit 0 --hard-limit max -i 0 2>&1)
  rc=$?
  if [ $rc != 0 ]; then
    out="$out (exit $rc); then with --hard-limit $total_mib: "
    out+=$(timeout 20 "$smi" memory-limits --set -n "$2" --soft-limit 0 --hard-limit "$total_mib" -i 0 2>&1)
    rc=$?
  fi
  note "$1" clear "$out (exit $rc)"
}

read_limits() { # CHECK KEY CGROUP: the limits as nvidia-smi shows them (the forms it may take), and
  # the cgroup's dmem files where the kernel's dmem backend keeps them (read, never written)
  local f out tried=""
  for f in "--get -n $3 -i 0" "-n $3 -i 0"; do
    # shellcheck disable=SC2086
    if out=$(timeout 20 "$smi" memory-limits $f 2>&1); then
      note "$1" "${2}_smi" "memory-limits $f: $out"
      tried=""
      break
    fi
    tried+="memory-limits $f: $out (failed); "
  done
  [ -n "$tried" ] && note "$1" "${2}_smi" "$tried"
  for f in dmem.max dmem.min dmem.low dmem.current; do
    [ -f "$3/$f" ] && note "$1" "${2}_${f//./_}" "$(cat "$3/$f" 2>&1)"
  done
  return 0
}

# ---------------------------------------------------------------------------------------------
# A case's own process: `bash mps-limits.sh __case NAME`, with the main process's settings in
# its environment.

if [ "${1:-}" = __case ]; then
  read -r -a client <<<"$CHECK_CLIENT"
  trap 'exit 143' TERM
  trap stop_tracked EXIT
  "case_${2//-/_}"
  exit 0
fi

# ---------------------------------------------------------------------------------------------
# Main.

here=$(cd "$(dirname "$0")" && pwd)
self=$here/$(basename "$0")
out=${OUT:-/tmp}/mps-limits.json
limit_mib=${LIMIT_MIB:-2048}
cap_mib=$((limit_mib * 3))
hold=${HOLD_SECONDS:-4}
client_deadline=$((hold * 3 + 30))
cgroup_root=${CGROUP_ROOT:-/sys/fs/cgroup}

smi=$(find_bin nvidia-smi) || { echo "no nvidia-smi: not a GPU node"; exit 2; }
control=$(find_bin nvidia-cuda-mps-control) || { echo "no nvidia-cuda-mps-control: the driver's MPS tools are not installed"; exit 2; }
py=$(command -v python3) || { echo "no python3"; exit 2; }

uuid=$(query uuid)
mig_before=$(query mig.mode.current)
mode_before=$(query compute_mode)
total_mib=$(query memory.total)
free_mib=$(query memory.free)
driver=$(query driver_version)
echo "GPU 0: $uuid, $total_mib MiB, MIG mode $mig_before, compute mode $mode_before, driver $driver"

dir=$(mktemp -d /tmp/mpschk.XXXX)
# uid 1000's clients reach the pipe directories below.
chmod 0755 "$dir"
# Written as each result comes, so that what ran is there whatever stops the run.
report=$out
rm -f "$report"
cleanup() {
  local cg
  stop_tracked
  if [ -f "$dir/cgroups" ]; then
    # A memory-limits case cut off by its deadline: clear and remove its scratch cgroup.
    while read -r cg; do
      [ -d "$cg" ] || continue
      timeout 20 "$smi" memory-limits --set -n "$cg" --soft-limit 0 --hard-limit max -i 0 >/dev/null 2>&1 ||
        timeout 20 "$smi" memory-limits --set -n "$cg" --soft-limit 0 --hard-limit "$total_mib" -i 0 >/dev/null 2>&1
      rmdir "$cg" 2>/dev/null
    done <"$dir/cgroups"
  fi
  rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

cat >"$dir/h.py" <<'PY'
"""The report's helper: `note`, `client` (a client's record) and `finish` (verdicts, summary)."""
import json, os, re, sys

def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}

def save(path, r):
    with open(path + ".tmp", "w") as f:
        json.dump(r, f, indent=1)
    os.replace(path + ".tmp", path)

def put(path, check, key, value):
    r = load(path)
    (r if check == "." else r.setdefault("checks", {}).setdefault(check, {}))[key] = value
    save(path, r)

def value(s):
    try:
        return json.loads(s)
    except ValueError:
        return s

def lines(path):
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return []

def client(path, check, label, out, *kvs):
    """A client's record: its last JSON line, what was seen while it held, and whether it went
    through the daemon."""
    rec = {k: v for k, v in (kv.split("=", 1) for kv in kvs)}
    rec["held"] = rec.get("held") == "true"
    for k in ("used_mib_while_held", "waited_s"):
        rec[k] = value(rec.get(k, "null")) if rec.get(k) not in ("", None) else None
    outs = lines(out)
    result = None
    for line in reversed(outs):
        try:
            result = json.loads(line)
            break
        except ValueError:
            continue
    rec["result"] = result if result is not None else {"output": "\n".join(outs[-10:])}
    logs = lines(out + ".ctl") + lines(out + ".srv") + lines(out + ".dout")
    new = [l for l in logs if re.search(r"new client", l, re.I)]
    rec["new_client_log_lines"] = new[-10:]
    rec["client_pid_zero_in_logs"] = any(re.search(r"new client 0\b", l, re.I) for l in new)
    before = set(rec.get("servers_before", "").split())
    held = set(rec.get("servers_while_held", "").split())
    rec["new_servers"] = sorted(held - before)
    says = result.get("mps") if isinstance(result, dict) else None
    if says is not None:
        rec["connected"] = bool(says)
        rec["connected_by"] = "the client's own word (stand-in)"
    elif new or rec["new_servers"]:
        rec["connected"] = True
        rec["connected_by"] = "the daemon's logs" if new else "a new server"
    elif rec["held"]:
        rec["connected"] = False
        rec["connected_by"] = "it allocated with no new client in the daemon's logs and no new server: a plain context, or logs this check cannot read (see them)"
    else:
        rec["connected"] = None
        rec["connected_by"] = "not measured: the client never held (see its result)"
    put(path, check, label, rec)

def alloc(rec):
    r = rec.get("result") if isinstance(rec, dict) else None
    return r.get("allocated_mib") if isinstance(r, dict) else None

def why_not(rec):
    r = rec.get("result") if isinstance(rec, dict) else None
    if isinstance(r, dict):
        return r.get("error") or r.get("output") or f"no allocation figure in {json.dumps(r)[:160]}"
    return "no record (cut off by its deadline?)"

def limits_verdict(c):
    soft, hard = c["soft_mib"], c["hard_mib"]
    def shown(key, soft_v, hard_v):
        smi = c.get(key + "_smi", "")
        dmin, dmax = c.get(key + "_dmem_min", ""), c.get(key + "_dmem_max", "")
        if dmin and dmax:
            # One line per memory region ("nvidia/<pci>/vidmem <bytes>"): one of them is ours.
            has = lambda text, v: any(l.split()[-1] == v for l in text.splitlines() if l.split())
            return f"dmem.min {'matches' if has(dmin, soft_v[1]) else 'DIFFERS'}, " \
                   f"dmem.max {'matches' if has(dmax, hard_v[1]) else 'DIFFERS'}"
        if smi and "(failed)" not in smi:
            return "in nvidia-smi's answer" if soft_v[0] in smi and hard_v[0] in smi else "not in nvidia-smi's answer"
        return "not read back"
    mib = 1 << 20
    out = {"set": c["set_ok"],
           "read_back": shown("read_back", (str(soft), str(soft * mib)), (str(hard), str(hard * mib))),
           "read_back_after_clear": shown("read_back_after_clear", ("0", "0"), ("max", "max")),
           "cleared": c.get("clear", "").endswith("(exit 0)"),
           "cgroup_removed": c.get("cgroup_removed") is True}
    for label, cap in (("past-hard", hard * 2), ("under-hard", hard // 2),
                       ("past-hard-without-mps", hard * 2)):
        if label not in c:
            continue
        a = alloc(c[label])
        out[label] = (f"not measured: {why_not(c[label])}" if a is None else
                      f"{a} MiB of {cap} asked ({c[label]['result'].get('stopped_by')})")
    for label, key in (("past-hard", "hard_limit_held"),
                       ("past-hard-without-mps", "hard_limit_held_without_mps")):
        a = alloc(c.get(label, {}))
        if a is not None:
            out[key] = a <= hard
    return out

def verdicts(r):
    checks = r.get("checks", {})
    limit = r.get("limit_mib")
    for name, c in checks.items():
        if "not_measured" in c:
            continue
        if name == "key-forms":
            out = {}
            for k in ("uuid-key", "index-key", "index-key-gib"):
                a = alloc(c.get(k, {}))
                out[k] = (f"not measured: {why_not(c.get(k, {}))}" if a is None else
                          "applied" if a <= limit else f"not applied ({a} MiB allocated)")
            t = c.get("threads-25", {}).get("result") or {}
            n = c.get("no-limit", {}).get("result") or {}
            out["threads-25"] = (f"multiprocessors {t.get('multiprocessors')} against {n.get('multiprocessors')} without"
                                 if isinstance(t, dict) and t.get("multiprocessors") else "not measured")
            c["verdict"] = out
        elif name == "default-limit":
            a = alloc(c.get("client-asks-more", {}))
            b = alloc(c.get("client-asks-nothing", {}))
            d, m = c.get("default_mib"), c.get("client_mib")
            if a is None:
                c["verdict"] = f"not measured: {why_not(c.get('client-asks-more', {}))}"
            else:
                c["verdict"] = ("the daemon's default wins" if a <= d else
                                "the client's value wins" if a <= m else "neither applied") + \
                    f" ({a} MiB allocated; default {d}, client {m}; a client asking nothing got {b})"
        elif name == "concurrent":
            out = {}
            base = c.get("used_mib_with_daemon")
            for n in (1, 2, 4):
                recs = [c.get(f"{n}-{i}", {}) for i in range(1, n + 1)]
                got = [alloc(x) for x in recs]
                used = c.get(f"used_mib_with_{n}")
                if None in got or not isinstance(used, (int, float)) or not isinstance(base, (int, float)):
                    bad = next((x for x, g in zip(recs, got) if g is None), {})
                    out[str(n)] = f"not measured: {sum(g is not None for g in got)} of {n} clients allocated ({why_not(bad)})"
                else:
                    mps = used - base - sum(got)
                    out[str(n)] = {"mps_mib": mps, "per_client_mib": round(mps / n, 1),
                                   "allocated_mib": sum(got)}
            c["verdict"] = out
        elif name == "memory-limits" and "set_ok" in c:
            c["verdict"] = limits_verdict(c)

def finish(path):
    r = load(path)
    verdicts(r)
    save(path, r)
    if "skipped" in r:
        print(f"skipped: {r['skipped']}")
        return
    for name, c in r.get("checks", {}).items():
        if "not_measured" in c:
            head = f"not measured: {c['not_measured']}"
        elif "verdict" in c:
            head = json.dumps(c["verdict"])
        else:
            conn = {k: v.get("connected") for k, v in c.items() if isinstance(v, dict) and "connected" in v}
            extra = {k: c[k] for k in ("obeyed", "restarted", "cgroup_removed") if k in c}
            head = json.dumps({**conn, **extra}) if conn or extra else "(see the report)"
        if c.get("timed_out"):
            kept = [k for k in c if k not in ("deadline_s", "elapsed_s", "timed_out")]
            head = f"past its deadline ({c.get('deadline_s')} s), having recorded {kept}: " + head
        print(f"{name}: {head}")

if __name__ == "__main__":
    cmd, path, *rest = sys.argv[1:]
    if cmd == "note":
        check, key, kind, v = rest
        put(path, check, key, value(v) if kind == "json" else v)
    elif cmd == "client":
        client(path, *rest)
    elif cmd == "finish":
        finish(path)
PY

note . gpu "$uuid"
note . driver "$driver"
notej . total_mib "${total_mib:-null}"
# The figures mean something only where this was (nearly) all of it.
notej . free_mib "${free_mib:-null}"
# What the daemons get here, against what the MPS host gives them.
note . setup "pipe directories 0777 and log directories 0700 as src/mps/dir.rs makes them; the node's /dev/shm (the MPS host gives each daemon its own)"
note . mig_mode "$mig_before"
note . compute_mode "$mode_before"
notej . limit_mib "$limit_mib"
notej . cap_mib "$cap_mib"
notej . hold_seconds "$hold"
note . workdir "$dir"
if [ "$mig_before" = Enabled ]; then
  # MIG devices are no MPS v3 target and this check would have to pick one: nothing is started.
  note . skipped "MIG enabled"
  "$py" "$dir/h.py" finish "$report"
  exit 0
fi

# -M only where the daemon's own help lists it (NVIDIA's public MPS v2 flags do not), asked with
# an empty pipe directory so that nothing of the node's is reached.
mkdir -p "$dir/help"
help=$(CUDA_MPS_PIPE_DIRECTORY=$dir/help timeout 10 "$control" -h </dev/null 2>&1)
m_line=$(grep -E -- '(^|[[:space:],])-M([[:space:],=]|$)' <<<"$help" | head -n 3)
note . control_help_M_line "${m_line:-absent}"
note . control_help_multiuser_lines "$(grep -i multi <<<"$help" | head -n 5)"
note . control_help_head "$(head -n 5 <<<"$help")"
multi=""
[ -n "$m_line" ] && multi=-M
note . daemon_flags "-f $multi"

if [ -n "${MPS_CHECK_CLIENT:-}" ]; then
  CHECK_CLIENT=$MPS_CHECK_CLIENT
else
  CHECK_CLIENT="$py $here/mps_client.py"
fi
export smi control py uuid driver total_mib dir report multi limit_mib cap_mib hold \
  client_deadline cgroup_root here CHECK_CLIENT

declare -A deadline=(
  [host-start]=30 [key-forms]=75 [pid-namespace]=35 [uid-1000]=45 [concurrent]=75
  [default-limit]=40 [sigkill-restart]=45 [quit-as-uid-1000]=25 [memory-limits]=50
)
overrides=${DEADLINES:-}
for kv in ${overrides//,/ }; do
  [[ $kv =~ ^([a-z0-9-]+)=([0-9]+)$ ]] && [ -n "${deadline[${BASH_REMATCH[1]}]:-}" ] ||
    { echo "DEADLINES: $kv is not <case>=<seconds>"; exit 2; }
  deadline[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}
done
for check in host-start key-forms pid-namespace uid-1000 concurrent default-limit \
  sigkill-restart quit-as-uid-1000 memory-limits; do
  if [ -n "${CASES:-}" ] && ! grep -qw -- "$check" <<<"${CASES//,/ }"; then
    continue
  fi
  echo "$check (deadline ${deadline[$check]} s)"
  t0=$SECONDS
  timeout -k 5 "${deadline[$check]}" bash "$self" __case "$check" </dev/null
  rc=$?
  notej "$check" deadline_s "${deadline[$check]}"
  notej "$check" elapsed_s "$((SECONDS - t0))"
  if [ $rc = 124 ] || [ $rc = 137 ]; then
    notej "$check" timed_out true
  fi
  # Whatever the case left running (it was cut off, or a daemon did not quit).
  stop_tracked
done

mig_after=$(query mig.mode.current)
mode_after=$(query compute_mode)
echo "after: MIG mode $mig_after, compute mode $mode_after"
note . mig_mode_after "$mig_after"
note . compute_mode_after "$mode_after"
"$py" "$dir/h.py" finish "$report"
if [ "$mig_after" != "$mig_before" ] || [ "$mode_after" != "$mode_before" ]; then
  notej . settings_unchanged false
  echo "GPU settings changed!"
  exit 1
fi
notej . settings_unchanged true
echo "report: $out"
