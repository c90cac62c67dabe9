//! The prepared device check (`tests/device/mps-limits.sh`) run here end to end, on stand-ins:
//! `nvidia-smi` a script that answers the queries the check makes (in nvidia-smi's documented
//! CSV form) and keeps the memory limits it is given where the driver's `dmem` backend keeps
//! them, `nvidia-cuda-mps-control` the MPS stand-in (daemons, servers and clients as real
//! processes), a client program over the stand-in's CUDA client in place of CUDA, and a
//! directory with a `cgroup.controllers` as the cgroup v2 root. What is checked is the check
//! itself, so that the one run a lent GPU allows is not spent on a broken script:
//!
//! - every case runs within its deadline and writes its result, or says why it has none;
//! - daemons start as the MPS host starts them, clients reach them (as uid 1000 too, from
//!   outside the daemon's PID namespace too) with the environment each case gives them, a
//!   SIGKILLed daemon is followed by a new one over its directories, the scratch cgroup gets its
//!   limits, its clients, and the limits cleared;
//! - it stops only what it started: processes named like MPS's own that it did not start are
//!   still running after it, and nothing it started is (no process has one of its pipe
//!   directories in its environment);
//! - it leaves a GPU in MIG mode alone, says why where the driver or cgroup version rules out
//!   the memory-limits case, and fails when a GPU setting changed under it.
//!
//! Its figures only mean something on a GPU. Needs bash and python3 (both in CI's image); run
//! as root (as CI is) it also runs the uid-1000 and PID-namespace cases.
//!
//! The read-only MIG check (`tests/device/mig-readonly.sh`) runs here too, on a stand-in
//! `nvidia-smi` that answers in nvidia-smi's documented formats (and refuses anything but the
//! queries the check may make), nvdra's simulated H100 node, the fake NVML for its ctypes reads
//! and copies of `sleep` named `nv-hostengine` and `nvidia-persistenced` holding stand-in device
//! files: on a consistent node it passes, naming the holders; NVML placements, profile facts,
//! a virtualization mode and settings that differ from nvdra's each fail it with the difference
//! named; an `nvidia-smi mig` silent with MIG off and a missing Python are recorded, not failed.

use crate::support;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use serde_json::Value;
use support::mps;

const UUID: &str = "GPU-11111111-2222-3333-4444-555555555555";
const OLD_DRIVER: &str = "580.95.05";
const R615_DRIVER: &str = "615.20.03";

/// A GPU node of stand-ins in a temporary directory that uid 1000 may enter. Dropped, it removes
/// the stand-in's markers of its processes from the host's `/dev/shm`.
struct Node {
    dir: tempfile::TempDir,
    created: std::time::SystemTime,
}

impl Drop for Node {
    fn drop(&mut self) {
        remove_standin_markers(self.created);
    }
}

impl Node {
    /// GPU 0 with `driver_version` and MIG mode `mig`; the compute mode `Default`, or
    /// `Exclusive_Process` from the second time it is asked when `mode_changes`.
    fn new(driver_version: &str, mig: &str, mode_changes: bool) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let node = Node {
            dir,
            created: std::time::SystemTime::now(),
        };
        open_to_all(node.path());
        mps::install_standin(&node.driver());
        for d in [node.driver(), node.driver().join("usr"), node.bin()] {
            open_to_all(&d);
        }
        let compute_mode = if mode_changes {
            // One answer, then another: the mode changed while the check ran.
            format!(
                "if [ -e '{seen}' ]; then echo Exclusive_Process; else touch '{seen}'; echo Default; fi",
                seen = node.path().join("mode-asked").display()
            )
        } else {
            "echo Default".into()
        };
        write_exe(
            &node.bin().join("nvidia-smi"),
            &FAKE_SMI
                .replace("@UUID@", UUID)
                .replace("@MIG@", mig)
                .replace("@DRIVER@", driver_version)
                .replace("@COMPUTE_MODE@", &compute_mode)
                .replace("@LOG@", &node.smi_log().display().to_string()),
        );
        write_exe(
            &node.client(),
            &CLIENT.replace(
                "@CONTROL@",
                &mps::control(&node.driver()).display().to_string(),
            ),
        );
        std::fs::create_dir_all(node.cgroup_root()).unwrap();
        std::fs::write(
            node.cgroup_root().join("cgroup.controllers"),
            "cpuset cpu io memory hugetlb pids rdma misc dmem\n",
        )
        .unwrap();
        node
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
    fn driver(&self) -> PathBuf {
        self.path().join("driver")
    }
    fn bin(&self) -> PathBuf {
        self.driver().join("usr/bin")
    }
    fn client(&self) -> PathBuf {
        self.path().join("client.sh")
    }
    fn smi_log(&self) -> PathBuf {
        self.path().join("smi.log")
    }
    fn cgroup_root(&self) -> PathBuf {
        self.path().join("cgroup")
    }
    fn report_path(&self) -> PathBuf {
        self.path().join("mps-limits.json")
    }

    /// Runs the check with `env` added; its output and its report.
    fn run(&self, env: &[(&str, &str)]) -> (Output, Value) {
        let path = format!(
            "{}:{}",
            self.bin().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let out = Command::new("bash")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/device/mps-limits.sh"
            ))
            .env("PATH", path)
            .env("OUT", self.path())
            .env("HOLD_SECONDS", "1")
            .env("MPS_CHECK_CLIENT", self.client())
            .env("CGROUP_ROOT", self.cgroup_root())
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let report: Value = serde_json::from_slice(
            &std::fs::read(self.report_path()).unwrap_or_else(|e| panic!("no report ({e})")),
        )
        .unwrap_or_else(|e| panic!("the report is not JSON ({e}):\n{}", text(&out)));
        (out, report)
    }
}

/// nvidia-smi as the check asks it: the `--query-gpu` fields in `csv,noheader,nounits` form, no
/// compute processes, and `memory-limits --set`, kept where the driver's dmem backend keeps a
/// cgroup's limits (hard as `dmem.max`, soft as `dmem.min`, bytes; NVIDIA's MPS v3 docs) and
/// logged; anything else is refused as nvidia-smi refuses an unknown flag (exit 2).
const FAKE_SMI: &str = r#"#!/bin/sh
case "$*" in
  *--query-gpu=uuid\ *) echo @UUID@ ;;
  *--query-gpu=mig.mode.current\ *) echo @MIG@ ;;
  *--query-gpu=compute_mode\ *) @COMPUTE_MODE@ ;;
  *--query-gpu=memory.total\ *) echo 81559 ;;
  *--query-gpu=memory.used\ *) echo 0 ;;
  *--query-gpu=memory.free\ *) echo 81008 ;;
  *--query-gpu=driver_version\ *) echo @DRIVER@ ;;
  *--query-compute-apps=*) ;;
  "memory-limits --set "*)
    shift 2
    while [ $# -gt 0 ]; do
      case "$1" in
        -n) cg=$2 ;; --soft-limit) soft=$2 ;; --hard-limit) hard=$2 ;; -i) ;;
        *) echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."; exit 2 ;;
      esac
      shift 2
    done
    echo "set $cg $soft $hard" >>'@LOG@'
    bytes() { if [ "$1" = max ]; then echo max; else echo $(($1 * 1048576)); fi; }
    echo "nvidia/0000:01:00.0/vidmem $(bytes "$hard")" >"$cg/dmem.max"
    echo "nvidia/0000:01:00.0/vidmem $(bytes "$soft")" >"$cg/dmem.min" ;;
  *) echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."; exit 2 ;;
esac
"#;

/// The check's client program (in place of `mps_client.py`, which needs CUDA): the stand-in's
/// CUDA client, its first line as JSON (`"mps"`: whether it went through a daemon), held for
/// HOLD_SECONDS when it got a context; POSIX sh, so that uid 1000 runs it too.
const CLIENT: &str = r#"#!/bin/sh
out=$(mktemp) || exit 1
'@CONTROL@' cuda-client >"$out" 2>"$out.err" </dev/null &
pid=$!
i=0
while [ ! -s "$out" ] && [ ! -s "$out.err" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i + 1)); done
line=$(head -n 1 "$out")
case "$line" in
  connected*) mps=true ;;
  *) mps=false ;;
esac
json="{\"standin\": \"$line\", \"pid\": $$, \"uid\": $(id -u), \"limit_env\": \"${CUDA_MPS_PINNED_DEVICE_MEM_LIMIT:-}\", \"thread_env\": \"${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:-}\""
if [ -n "$line" ]; then
  echo "$json, \"holding\": true}"
  sleep "${HOLD_SECONDS:-0}"
else
  json="$json, \"error\": \"$(tr -d '"\\' <"$out.err" | tr '\n' ' ')\""
fi
kill $pid 2>/dev/null
wait $pid 2>/dev/null
rm -f "$out" "$out.err"
echo "$json, \"mps\": $mps}"
"#;

fn write_exe(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn open_to_all(dir: &Path) {
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn text(out: &Output) -> String {
    format!(
        "{}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn is_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// A process named as MPS's own that the check did not start, as another share's daemon on the
/// node would be: a copy of `sleep` called `name`. Killed when dropped.
struct Bystander(Child);

impl Bystander {
    fn start(dir: &Path, name: &str) -> Bystander {
        Bystander::start_with(dir, name, |_| {})
    }

    /// The same, its command set up by `configure` (e.g. a device file as its stdin).
    fn start_with(dir: &Path, name: &str, configure: impl FnOnce(&mut Command)) -> Bystander {
        let sleep = ["/bin/sleep", "/usr/bin/sleep"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .expect("a sleep binary");
        let exe = dir.join(name);
        std::fs::copy(sleep, &exe).unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut cmd = Command::new(&exe);
        cmd.arg("600")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        configure(&mut cmd);
        Bystander(cmd.spawn().unwrap())
    }
}

impl Drop for Bystander {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The processes whose environment names a pipe directory under `workdir` (the check's).
fn left_behind(workdir: &str) -> Vec<String> {
    let needle = format!("CUDA_MPS_PIPE_DIRECTORY={workdir}/");
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(env) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if env
            .split(|b| *b == 0)
            .any(|v| v.starts_with(needle.as_bytes()))
            && mps::runs(pid)
        {
            let cmd = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            found.push(format!(
                "{pid}: {}",
                String::from_utf8_lossy(&cmd).replace('\0', " ")
            ));
        }
    }
    found
}

/// Removes the markers the stand-in's daemons and servers wrote into the host's `/dev/shm` (the
/// check gives them no private one) since `since`, for processes that no longer run (a marker of
/// the PID-namespace case names a PID of that namespace: no stand-in of ours has it here).
fn remove_standin_markers(since: std::time::SystemTime) {
    for entry in std::fs::read_dir("/dev/shm")
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("nvdra-standin-")
            .and_then(|rest| rest.rsplit('.').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let recent = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t >= since);
        let standin = std::fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| c.windows(12).any(|w| w == b"mps-standin\0"));
        if recent && !(mps::runs(pid) && standin) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

fn check<'a>(report: &'a Value, name: &str) -> &'a Value {
    let c = &report["checks"][name];
    assert!(c.is_object(), "no check {name} in the report: {report:#}");
    c
}

/// The client record `label` of check `c`: it ran, and says whether it connected.
fn client<'a>(c: &'a Value, label: &str) -> &'a Value {
    let r = &c[label];
    assert!(
        r["connected"].is_boolean(),
        "{label}: no connection verdict: {r:#}"
    );
    r
}

fn standin_line(r: &Value) -> &str {
    r["result"]["standin"].as_str().unwrap_or_default()
}

#[test]
fn the_check_runs_every_case_on_stand_ins_and_stops_only_what_it_started() {
    let node = Node::new(R615_DRIVER, "Disabled", false);
    let others = [
        Bystander::start(node.path(), "nvidia-cuda-mps-control"),
        Bystander::start(node.path(), "nvidia-cuda-mps-server"),
    ];
    let (out, report) = node.run(&[]);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(
        all.contains("after: MIG mode Disabled, compute mode Default"),
        "{all}"
    );
    assert_eq!(report["gpu"], UUID);
    assert_eq!(report["settings_unchanged"], true, "{report:#}");

    // It stopped only what it started, and everything it started.
    for mut b in others {
        assert!(
            b.0.try_wait().unwrap().is_none(),
            "the check ended a process it did not start"
        );
    }
    let workdir = report["workdir"].as_str().unwrap();
    assert_eq!(left_behind(workdir), Vec::<String>::new(), "left running");
    assert!(!Path::new(workdir).exists(), "{workdir} is left");

    // Every case ran within its deadline and wrote what it found.
    let names = [
        "host-start",
        "key-forms",
        "pid-namespace",
        "uid-1000",
        "concurrent",
        "default-limit",
        "sigkill-restart",
        "quit-as-uid-1000",
        "memory-limits",
    ];
    for name in names {
        let c = check(&report, name);
        assert!(c.get("timed_out").is_none(), "{name}: {c:#}");
        assert!(
            c["elapsed_s"].as_u64().unwrap() <= c["deadline_s"].as_u64().unwrap(),
            "{name}: {c:#}"
        );
    }

    // The daemon's flags: -M only where its help lists it (the stand-in's may not).
    let flags = report["daemon_flags"].as_str().unwrap();
    let multi_user = report["control_help_M_line"] != "absent";
    assert_eq!(flags.contains("-M"), multi_user, "{report:#}");

    // host-start: the daemon answered and a client went through it.
    let c = check(&report, "host-start");
    assert_eq!(c["answered"], true, "{c:#}");
    assert_eq!(client(c, "client")["connected"], true, "{c:#}");

    // key-forms: each client got its case's environment (the stand-in client echoes it); no
    // figure without CUDA, and the verdict says so.
    let c = check(&report, "key-forms");
    for (label, limit, threads) in [
        ("no-limit", "unset", "unset"),
        ("uuid-key", &*format!("{UUID}=2048M"), "unset"),
        ("index-key", "0=2048M", "unset"),
        ("index-key-gib", "0=2G", "unset"),
        ("threads-25", "unset", "25"),
    ] {
        let line = standin_line(client(c, label));
        assert!(
            line.contains(&format!(" pinned={limit} "))
                && line.contains(&format!(" threads={threads} ")),
            "{label}: {line}"
        );
    }
    assert!(
        c["verdict"]["index-key"]
            .as_str()
            .unwrap()
            .starts_with("not measured"),
        "{c:#}"
    );

    // concurrent: 1, 2 and 4 clients, each connected; the memory figures asked for each.
    let c = check(&report, "concurrent");
    for (n, labels) in [
        (1, &["1-1"][..]),
        (2, &["2-1", "2-2"]),
        (4, &["4-1", "4-2", "4-3", "4-4"]),
    ] {
        for label in labels {
            assert_eq!(client(c, label)["connected"], true, "{label}: {c:#}");
        }
        assert!(c[format!("used_mib_with_{n}")].is_number(), "{c:#}");
        assert!(
            c["verdict"][n.to_string()]
                .as_str()
                .unwrap()
                .starts_with("not measured"),
            "{c:#}"
        );
    }
    assert!(c["used_mib_before_daemon"].is_number(), "{c:#}");

    // default-limit: the daemon was sent the default (the stand-in answers that it does not
    // know it) and the client asked for more.
    let c = check(&report, "default-limit");
    assert!(
        c["set_answer"]
            .as_str()
            .unwrap()
            .contains("set_default_device_pinned_mem_limit 0 2048M"),
        "{c:#}"
    );
    assert!(
        standin_line(client(c, "client-asks-more")).contains(" pinned=0=4096M "),
        "{c:#}"
    );
    assert!(
        c["verdict"].as_str().unwrap().starts_with("not measured"),
        "{c:#}"
    );

    // sigkill-restart: the daemon and its server went, a new daemon over the same directories
    // answered and served.
    let c = check(&report, "sigkill-restart");
    assert_eq!(c["restarted"], true, "{c:#}");
    assert_eq!(client(c, "before-kill")["connected"], true, "{c:#}");
    assert_eq!(client(c, "after-restart")["connected"], true, "{c:#}");
    assert!(
        c["stale_files"].as_str().unwrap().contains("control"),
        "{c:#}"
    );
    let log = mps::log(&node.driver());
    let restart_pipe = format!("{workdir}/restart/pipe");
    let starts = |pipe: &str| {
        log.iter()
            .filter(|l| **l == format!("start {UUID} {pipe}"))
            .count()
    };
    let quits = |pipe: &str| log.iter().filter(|l| **l == format!("quit {pipe}")).count();
    assert_eq!(starts(&restart_pipe), 2, "{log:#?}");
    assert_eq!(quits(&restart_pipe), 1, "{log:#?}");

    // Every other daemon started as the MPS host starts it, for the GPU, and quit when asked.
    for name in ["host", "keys", "conc", "deflim", "cgroup"] {
        let pipe = format!("{workdir}/{name}/pipe");
        assert_eq!((starts(&pipe), quits(&pipe)), (1, 1), "{name}: {log:#?}");
    }
    assert!(
        log.iter()
            .all(|l| !l.starts_with("start ") || l.starts_with(&format!("start {UUID} "))),
        "{log:#?}"
    );

    // memory-limits (driver 615, cgroup v2): the scratch cgroup got both limits, read back as
    // set; its clients ran in it; the limits were cleared; it was removed (here: tried, as a
    // plain directory keeps the files the fakes wrote).
    let c = check(&report, "memory-limits");
    let v = &c["verdict"];
    assert_eq!(v["set"], true, "{c:#}");
    assert_eq!(
        v["read_back"], "dmem.min matches, dmem.max matches",
        "{c:#}"
    );
    assert_eq!(
        v["read_back_after_clear"], "dmem.min matches, dmem.max matches",
        "{c:#}"
    );
    assert_eq!(v["cleared"], true, "{c:#}");
    let cgroup = c["cgroup"].as_str().unwrap();
    assert!(
        cgroup.starts_with(&node.cgroup_root().display().to_string()),
        "{c:#}"
    );
    let smi = std::fs::read_to_string(node.smi_log()).unwrap();
    assert!(
        smi.starts_with(&format!("set {cgroup} 1024 2048\nset {cgroup} 0 max\n")),
        "{smi}"
    );
    let procs = std::fs::read_to_string(Path::new(cgroup).join("cgroup.procs")).unwrap();
    assert!(procs.trim().parse::<u32>().is_ok(), "{procs:?}");
    assert_eq!(client(c, "past-hard")["connected"], true, "{c:#}");
    assert_eq!(client(c, "under-hard")["connected"], true, "{c:#}");
    // The third reached no daemon, on purpose.
    assert_eq!(
        client(c, "past-hard-without-mps")["connected"],
        false,
        "{c:#}"
    );
    assert!(
        c["cgroup_removed"]
            .as_str()
            .is_some_and(|s| s.contains("rmdir")),
        "{c:#}"
    );

    // The cases that need root: uid 1000 and a PID namespace of the daemon's own.
    let uid = check(&report, "uid-1000");
    let pidns = check(&report, "pid-namespace");
    let quit = check(&report, "quit-as-uid-1000");
    if !is_root() {
        for c in [uid, quit] {
            assert!(
                c["not_measured"].as_str().unwrap().contains("uid 1000"),
                "{c:#}"
            );
        }
        assert!(pidns["not_measured"].is_string(), "{pidns:#}");
        return;
    }
    // A client of uid 1000 went through the daemon; root's beside it did only in multi-user
    // mode (the stand-in refuses another UID without -M, where MPS makes it wait).
    let r = client(uid, "uid-1000");
    assert_eq!(r["result"]["uid"], 1000, "{r:#}");
    assert_eq!(r["connected"], true, "{r:#}");
    let r = client(uid, "root-beside");
    assert_eq!(r["result"]["uid"], 0, "{r:#}");
    assert_eq!(r["connected"], multi_user, "{r:#}");
    // The daemon ran as a namespace's second process (its shell is the first), and a client
    // outside reached it.
    assert_eq!(pidns["answered"], true, "{pidns:#}");
    let line = pidns["log_daemon_out"].as_str().unwrap();
    let pid: u32 = line
        .strip_prefix("stand-in MPS control daemon ")
        .and_then(|rest| rest.split(' ').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(pid < 10, "not in a PID namespace of its own: {line}");
    assert_eq!(client(pidns, "client")["connected"], true, "{pidns:#}");
    // The stand-in obeys anyone's quit.
    assert_eq!(quit["obeyed"], true, "{quit:#}");
    assert!(
        quit["answer"].as_str().unwrap().contains("(exit 0)"),
        "{quit:#}"
    );
}

#[test]
fn the_memory_limits_case_says_why_it_does_not_run_on_an_older_driver_or_cgroup_v1() {
    // An older driver, with cgroup v2.
    let node = Node::new(OLD_DRIVER, "Disabled", false);
    let (out, report) = node.run(&[("CASES", "memory-limits")]);
    assert!(out.status.success(), "{}", text(&out));
    let c = check(&report, "memory-limits");
    let why = c["not_measured"].as_str().unwrap();
    assert!(
        why.starts_with(&format!("driver {OLD_DRIVER} / cgroup ")),
        "{why}"
    );
    // Only the case asked for ran.
    assert_eq!(report["checks"].as_object().unwrap().len(), 1, "{report:#}");
    // R615, but cgroup v1 (no cgroup.controllers at the root).
    let node = Node::new(R615_DRIVER, "Disabled", false);
    std::fs::remove_file(node.cgroup_root().join("cgroup.controllers")).unwrap();
    let (out, report) = node.run(&[("CASES", "memory-limits")]);
    assert!(out.status.success(), "{}", text(&out));
    let c = check(&report, "memory-limits");
    assert_eq!(c["cgroup_v2"], false, "{c:#}");
    assert!(
        c["not_measured"]
            .as_str()
            .unwrap()
            .starts_with(&format!("driver {R615_DRIVER} / cgroup ")),
        "{c:#}"
    );
    // Nothing was set, nothing made.
    assert!(!node.smi_log().exists());
    assert_eq!(std::fs::read_dir(node.cgroup_root()).unwrap().count(), 0);
}

#[test]
fn a_case_past_its_deadline_is_cut_off_and_leaves_nothing_running() {
    // The client holds for 10 s; the case has 3.
    let node = Node::new(R615_DRIVER, "Disabled", false);
    let (out, report) = node.run(&[
        ("CASES", "host-start"),
        ("DEADLINES", "host-start=3"),
        ("HOLD_SECONDS", "10"),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let c = check(&report, "host-start");
    assert_eq!(c["timed_out"], true, "{c:#}");
    assert_eq!(c["deadline_s"], 3, "{c:#}");
    // What it found before the deadline is kept; the client it was waiting for is not.
    assert_eq!(c["answered"], true, "{c:#}");
    assert!(c.get("client").is_none(), "{c:#}");
    let workdir = report["workdir"].as_str().unwrap();
    assert_eq!(left_behind(workdir), Vec::<String>::new(), "left running");
    // Its daemon was killed, not asked to quit.
    let log = mps::log(&node.driver());
    assert_eq!(log.len(), 1, "{log:#?}");
    assert!(log[0].starts_with("start "), "{log:#?}");
}

#[test]
fn a_gpu_in_mig_mode_is_left_alone() {
    let node = Node::new(R615_DRIVER, "Enabled", false);
    let (out, report) = node.run(&[]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(report["skipped"], "MIG enabled", "{report:#}");
    assert!(report.get("checks").is_none(), "{report:#}");
    assert_eq!(mps::log(&node.driver()), Vec::<String>::new());
}

#[test]
fn a_gpu_setting_changed_while_it_ran_fails_the_check() {
    let node = Node::new(R615_DRIVER, "Disabled", true);
    let (out, report) = node.run(&[("CASES", "none")]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("GPU settings changed!"),
        "{}",
        text(&out)
    );
    assert_eq!(report["settings_unchanged"], false, "{report:#}");
    assert_eq!(report["compute_mode_after"], "Exclusive_Process");
}

#[test]
fn the_cuda_client_prints_one_json_line_whatever_it_finds() {
    // Without a GPU it says why it has no figure (here no CUDA library; on a host with CUDA
    // and no GPU, CUDA's error); with one, what it allocated. Its pid is there, for the logs.
    let out = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/device/mps_client.py"
        ))
        .args(["128", "128"])
        .env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=2048M")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    let [line] = lines.as_slice() else {
        panic!("{stdout}");
    };
    let v: Value = serde_json::from_str(line).unwrap();
    assert!(
        v["error"].is_string() || v["allocated_mib"].is_number(),
        "{v}"
    );
    assert!(v["pid"].is_number() && v["uid"].is_number(), "{v}");
    assert_eq!(v["limit_env"], "0=2048M");
}

// -----------------------------------------------------------------------------------------------
// tests/device/mig-readonly.sh: the read-only MIG check, on a simulated H100 node.

/// The simulated node the MIG check's nvdra reads (and the fake NVML serves the same GPUs).
const MIG_NVDRA_ARGS: &str = "--profile dgx-h100 --node-name n";

/// nvidia-smi for the MIG check: answers the queries it makes from files in DIR (written by
/// [`MigNode`], in nvidia-smi's documented formats) and logs each (`ok ARGS`); anything else, a
/// setter included, is refused as nvidia-smi refuses an unknown flag and logged `refused ARGS`.
/// From the second `--query-gpu` with names on, `gpus.after.csv` answers when it exists (a
/// setting changed while the check ran).
const MIG_SMI: &str = r#"#!/bin/sh
d='@DIR@'
log() { echo "$1 $2" >>"$d/smi.log"; }
case "$*" in
  "--query-gpu=index,uuid,mig.mode.current,mig.mode.pending,compute_mode,name --format=csv,noheader")
    log ok "$*"
    if [ -e "$d/gpus.after.csv" ] && [ -e "$d/asked" ]; then cat "$d/gpus.after.csv"; else touch "$d/asked"; cat "$d/gpus.csv"; fi ;;
  "--query-gpu=index,uuid,mig.mode.current,mig.mode.pending,compute_mode --format=csv,noheader")
    log ok "$*"; sed 's/, [^,]*$//' "$d/gpus.csv" ;;
  "-q" | "-q -i 0") log ok "$*"; cat "$d/q.txt" ;;
  "mig -i 0 -lgip") log ok "$*"; cat "$d/lgip.txt"; exit "$(cat "$d/mig.rc")" ;;
  "mig -i 0 -lgipp") log ok "$*"; cat "$d/lgipp.txt"; exit "$(cat "$d/mig.rc")" ;;
  "--query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader")
    log ok "$*"; cat "$d/apps.csv" ;;
  *) log refused "$*"; echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."; exit 2 ;;
esac
"#;

/// `nvidia-smi -q` of an idle H100 with MIG off (the part the check reads, as the R570 driver
/// prints it); `@VIRT@` is its virtualization mode.
const MIG_Q: &str = "
==============NVSMI LOG==============

Timestamp                                 : Sat Dec  5 12:00:00 2026
Driver Version                            : 570.124.06
CUDA Version                              : 12.8

Attached GPUs                             : 1
GPU 00000000:1A:00.0
    Product Name                          : NVIDIA H100 80GB HBM3
    Product Brand                         : NVIDIA
    Product Architecture                  : Hopper
    Display Mode                          : Disabled
    Persistence Mode                      : Enabled
    Addressing Mode                       : None
    MIG Mode
        Current                           : Disabled
        Pending                           : Disabled
    Accounting Mode                       : Disabled
    Driver Model
        Current                           : N/A
        Pending                           : N/A
    Minor Number                          : 0
    GPU Operation Mode
        Current                           : N/A
        Pending                           : N/A
    GPU C2C Mode                          : Disabled
    GPU Virtualization Mode
        Virtualization Mode               : @VIRT@
        Host VGPU Mode                    : N/A
        vGPU Heterogeneous Mode           : N/A
    GPU Reset Status
        Reset Required                    : No
        Drain and Reset Recommended       : No
";

/// `nvidia-smi mig -lgip` of an H100 80GB HBM3 (as printed on one, MIG on and no instance).
const MIG_LGIP: &str = "\
+-----------------------------------------------------------------------------+
| GPU instance profiles:                                                      |
| GPU   Name             ID    Instances   Memory     P2P    SM    DEC   ENC  |
|                              Free/Total   GiB              CE    JPEG  OFA  |
|=============================================================================|
|   0  MIG 1g.10gb       19     7/7        9.75       No     16     1     0   |
|                                                             1     1     0   |
+-----------------------------------------------------------------------------+
|   0  MIG 1g.10gb+me    20     1/1        9.75       No     16     1     0   |
|                                                             1     1     1   |
+-----------------------------------------------------------------------------+
|   0  MIG 1g.20gb       15     4/4        19.62      No     26     1     0   |
|                                                             1     1     0   |
+-----------------------------------------------------------------------------+
|   0  MIG 2g.20gb       14     3/3        19.62      No     32     2     0   |
|                                                             2     2     0   |
+-----------------------------------------------------------------------------+
|   0  MIG 3g.40gb        9     2/2        39.50      No     60     3     0   |
|                                                             3     3     0   |
+-----------------------------------------------------------------------------+
|   0  MIG 4g.40gb        5     1/1        39.50      No     64     4     0   |
|                                                             4     4     0   |
+-----------------------------------------------------------------------------+
|   0  MIG 7g.80gb        0     1/1        79.25      No     132    7     0   |
|                                                             8     7     1   |
+-----------------------------------------------------------------------------+
";

/// `nvidia-smi mig -lgipp` of an H100 (NVIDIA's MIG user guide).
const MIG_LGIPP: &str = "\
GPU  0 Profile ID 19 Placements: {0,1,2,3,4,5,6}:1
GPU  0 Profile ID 20 Placements: {0,1,2,3,4,5,6}:1
GPU  0 Profile ID 15 Placements: {0,2,4,6}:2
GPU  0 Profile ID 14 Placements: {0,2,4}:2
GPU  0 Profile ID  9 Placements: {0,4}:4
GPU  0 Profile ID  5 Placement : {0}:4
GPU  0 Profile ID  0 Placement : {0}:8
";

/// What the check's stand-in nvidia-smi answers, one file each; a GPU 0 that is the simulated
/// node's first GPU, its device files under `dev/`.
struct MigNode {
    dir: tempfile::TempDir,
    uuid: String,
}

impl MigNode {
    /// H100 0 of `--profile dgx-h100` as nvidia-smi shows it: MIG off, virtualization `virt`
    /// (nvidia-smi's word), one compute process.
    fn new(virt: &str) -> MigNode {
        let node = MigNode {
            dir: tempfile::tempdir().unwrap(),
            uuid: simulated_gpu0_uuid(),
        };
        std::fs::create_dir_all(node.bin()).unwrap();
        std::fs::create_dir_all(node.dev()).unwrap();
        for f in ["nvidia0", "nvidiactl"] {
            std::fs::write(node.dev().join(f), "").unwrap();
        }
        write_exe(
            &node.bin().join("nvidia-smi"),
            &MIG_SMI.replace("@DIR@", &node.path().display().to_string()),
        );
        node.write(
            "gpus.csv",
            &format!(
                "0, {}, Disabled, Disabled, Default, NVIDIA H100 80GB HBM3\n",
                node.uuid
            ),
        );
        node.write("q.txt", &MIG_Q.replace("@VIRT@", virt));
        node.write("lgip.txt", MIG_LGIP);
        node.write("lgipp.txt", MIG_LGIPP);
        node.write("mig.rc", "0");
        node.write(
            "apps.csv",
            &format!("{}, 4242, /usr/bin/python3, 1024 MiB\n", node.uuid),
        );
        node
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
    fn bin(&self) -> PathBuf {
        self.path().join("bin")
    }
    fn dev(&self) -> PathBuf {
        self.path().join("dev")
    }
    fn write(&self, name: &str, text: &str) {
        std::fs::write(self.path().join(name), text).unwrap();
    }

    /// A process called `name` (a copy of `sleep`) holding `files` under `dev/` open, as DCGM's
    /// host engine or the persistence daemon holds a GPU's device files. Killed when dropped.
    fn holder(&self, name: &str, files: &[&str]) -> Bystander {
        let open = |f: &str| std::fs::File::open(self.dev().join(f)).unwrap();
        Bystander::start_with(self.path(), name, |cmd| {
            cmd.stdin(open(files[0]));
            if let Some(f) = files.get(1) {
                cmd.stdout(open(f));
            }
        })
    }

    /// Runs the check with `env` added: its output, and the report it wrote.
    fn run(&self, env: &[(&str, &str)]) -> (Output, String) {
        let path = format!(
            "{}:{}",
            self.bin().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let out = Command::new("bash")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/device/mig-readonly.sh"
            ))
            .arg(env!("CARGO_BIN_EXE_nvdra"))
            .env("PATH", path)
            .env("OUT", self.path())
            .env("DEV_ROOT", self.dev())
            .env("NVDRA_ARGS", MIG_NVDRA_ARGS)
            .env("NVML_LIB", support::fake_nvml::library())
            .env("FAKE_NVML_PROFILE", "dgx-h100")
            .env("FAKE_NVML_SEED", "n")
            .env("REPEAT", "2")
            .env("WAIT_MS", "50")
            .env_remove("FAKE_NVML_NODE")
            .env_remove("FAKE_NVML_TOPOLOGY")
            .env_remove("FAKE_NVML_STATE")
            .env_remove("GPUS")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let report = std::fs::read_to_string(self.path().join("mig-readonly.txt"))
            .unwrap_or_else(|e| panic!("no report ({e}):\n{}", text(&out)));
        assert!(
            String::from_utf8_lossy(&out.stdout).starts_with(&report),
            "stdout and the report differ:\n{}",
            text(&out)
        );
        (out, report)
    }

    /// What the stand-in nvidia-smi was asked, one `ok ARGS` or `refused ARGS` a line.
    fn smi_log(&self) -> String {
        std::fs::read_to_string(self.path().join("smi.log")).unwrap_or_default()
    }
}

/// The UUID `nvdra inventory` gives GPU 0 of the simulated node.
fn simulated_gpu0_uuid() -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_nvdra"))
        .arg("inventory")
        .args(MIG_NVDRA_ARGS.split(' '))
        .args(["-o", "json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let inv: Value = serde_json::from_slice(&out.stdout).unwrap();
    inv["gpus"][0]["uuid"].as_str().unwrap().to_string()
}

/// The report's lines of `level` and `check` (e.g. "PASS", "placements"), without those.
fn lines_of(report: &str, level: &str, check: &str) -> Vec<String> {
    report
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            (words.next() == Some(level) && words.next() == Some(check)).then(|| {
                l.splitn(3, char::is_whitespace)
                    .nth(2)
                    .unwrap_or_default()
                    .trim_start()
                    .to_string()
            })
        })
        .collect()
}

/// The one line of `level` and `check` that contains `needle`.
fn line_with(report: &str, level: &str, check: &str, needle: &str) -> String {
    let found: Vec<String> = lines_of(report, level, check)
        .into_iter()
        .filter(|l| l.contains(needle))
        .collect();
    match found.as_slice() {
        [one] => one.clone(),
        _ => panic!("no single {level} {check} line with {needle:?}:\n{report}"),
    }
}

#[test]
fn the_mig_check_finds_a_consistent_node_consistent_and_names_its_holders() {
    let node = MigNode::new("None");
    let dcgm = node.holder("nv-hostengine", &["nvidia0"]);
    let persistenced = node.holder("nvidia-persistenced", &["nvidiactl", "nvidia0"]);
    let (out, report) = node.run(&[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        !report
            .lines()
            .any(|l| l.starts_with("FAIL") || l.starts_with("DIFF")),
        "{report}"
    );
    let uuid = &node.uuid;

    // 1. Bare metal by all three, and nvdra would switch it.
    let v = line_with(&report, "PASS", "virtualization", "GPU 0");
    assert!(
        v.contains(&format!("{uuid}) is bare metal"))
            && v.contains("(nvidia-smi -q: None; NVML: bareMetal; nvdra: bareMetal)"),
        "{v}"
    );
    let t = line_with(&report, "INFO", "mig-toggle", "GPU 0");
    assert!(
        t.contains("MIG TOGGLE says \"yes\"") && t.contains("architecture Hopper"),
        "{t}"
    );

    // 2. nvidia-smi answered with MIG off; each source agrees with nvdra's tables.
    line_with(
        &report,
        "INFO",
        "placements",
        "nvidia-smi mig -lgipp answers with MIG Disabled (7 profiles",
    );
    for agreed in [
        "nvidia-smi mig -lgipp and nvdra agree: 7 profiles, 25 placements",
        "nvidia-smi mig -lgip and nvdra agree: 7 profiles (names, instances, SMs)",
        "NVML through ctypes and nvdra agree: 7 profiles, 25 placements (names, instances, SMs, memory)",
    ] {
        line_with(&report, "PASS", "placements", agreed);
    }

    // 3. Each NVML call timed, REPEAT times where repeated.
    line_with(&report, "INFO", "timing", "nvdra inventory: ");
    line_with(&report, "INFO", "timing", "persistence mode Enabled");
    for call in [
        "nvmlDeviceGetMigMode",
        "nvmlDeviceGetVirtualizationMode",
        "nvmlDeviceGetComputeRunningProcesses_v3",
    ] {
        let l = line_with(&report, "INFO", "timing", &format!("{call}: first "));
        assert!(l.ends_with(" calls)"), "{l}");
    }
    line_with(&report, "INFO", "timing", "nvmlInit_v2: first ");

    // 4. Both holders of the GPU's device file, by PID and name, DCGM flagged; the compute
    // process nvidia-smi lists; persistenced also on nvidiactl.
    let dev = node.dev().display().to_string();
    let h = line_with(
        &report,
        "INFO",
        "holders",
        &format!("pid {} (nv-hostengine", dcgm.0.id()),
    );
    assert!(
        h.contains(&format!(
            "holds {dev}/nvidia0 — known: DCGM host engine: blocks a MIG switch"
        )),
        "{h}"
    );
    let h = line_with(
        &report,
        "INFO",
        "holders",
        &format!("pid {} (nvidia-persiste", persistenced.0.id()),
    );
    assert!(
        h.contains(&format!("holds {dev}/nvidia0 — known: nvidia-persistenced")),
        "{h}"
    );
    line_with(
        &report,
        "INFO",
        "holders",
        &format!(
            "node-wide device files held: {} (nvidia-persiste): {dev}/nvidiactl",
            persistenced.0.id()
        ),
    );
    line_with(
        &report,
        "INFO",
        "holders",
        "NVML compute process (nvidia-smi): 4242, /usr/bin/python3, 1024 MiB",
    );
    // The simulated backend reads no /proc: said, not failed.
    line_with(
        &report,
        "INFO",
        "holders",
        &format!("simulated backend does not name pid {}", dcgm.0.id()),
    );

    // 5. Registration, and a wait that timed out.
    let e = line_with(&report, "PASS", "events", "GPU 0");
    assert!(
        e.contains("register XID: SUCCESS, wait 50 ms: TIMEOUT"),
        "{e}"
    );
    line_with(&report, "PASS", "settings", "GPU 0: unchanged");

    // Read-only: the stand-in was asked only what it answers, the -lgipp query included.
    let log = node.smi_log();
    assert!(log.lines().all(|l| l.starts_with("ok ")), "{log}");
    assert!(log.contains("ok mig -i 0 -lgipp\n"), "{log}");
    // Both holders still run: the check signals nothing.
    for mut b in [dcgm, persistenced] {
        assert!(b.0.try_wait().unwrap().is_none(), "a holder was ended");
    }

    // 6. What needs a machine that may switch, listed at the end and in the README.
    let next = lines_of(&report, "NEXT", "needs-switch");
    assert_eq!(next.len(), 6, "{report}");
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    for item in &next {
        let head = item.split(':').next().unwrap();
        assert!(
            readme.contains(&format!("- {head}:")),
            "README does not list {head:?}"
        );
    }
}

#[test]
fn the_mig_check_fails_on_placements_virtualization_and_settings_that_differ() {
    let node = MigNode::new("Pass-Through");
    // An -lgipp without profile 20, with one 1g.20gb placement fewer and a profile nvdra does
    // not know; an -lgip whose 3g.40gb has fewer SMs; MIG mode left pending on by someone else.
    node.write(
        "lgipp.txt",
        &(MIG_LGIPP
            .replace("GPU  0 Profile ID 20 Placements: {0,1,2,3,4,5,6}:1\n", "")
            .replace("{0,2,4,6}:2", "{0,2,4}:2")
            + "GPU  0 Profile ID 47 Placements: {0,1,2,3,4,5,6}:1\n"),
    );
    node.write(
        "lgip.txt",
        &MIG_LGIP.replace(
            "|   0  MIG 3g.40gb        9     2/2        39.50      No     60",
            "|   0  MIG 3g.40gb        9     2/2        39.50      No     42",
        ),
    );
    node.write(
        "gpus.after.csv",
        &format!(
            "0, {}, Disabled, Enabled, Default, NVIDIA H100 80GB HBM3\n",
            node.uuid
        ),
    );
    let (out, report) = node.run(&[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));

    let mut diffs = lines_of(&report, "DIFF", "placements");
    diffs.sort();
    assert_eq!(
        diffs,
        [
            "GPU 0, nvidia-smi mig -lgip: profile 9 (3g.40gb) sms: NVML 42, nvdra 60",
            "GPU 0, nvidia-smi mig -lgipp: profile 15 (1g.20gb) placements: NVML {0,2,4}:2, nvdra {0,2,4,6}:2",
            "GPU 0, nvidia-smi mig -lgipp: profile 20 (1g.10gb+me) is in nvdra's tables, not NVML's",
            "GPU 0, nvidia-smi mig -lgipp: profile 47 is NVML's, not in nvdra's tables",
        ],
        "{report}"
    );
    line_with(
        &report,
        "FAIL",
        "placements",
        "GPU 0: nvidia-smi mig -lgipp and nvdra differ (3 differences",
    );
    line_with(
        &report,
        "FAIL",
        "placements",
        "GPU 0: nvidia-smi mig -lgip and nvdra differ (1 difference,",
    );
    // The fake NVML, from nvdra's own tables, still agrees.
    line_with(
        &report,
        "PASS",
        "placements",
        "NVML through ctypes and nvdra agree",
    );
    let v = line_with(&report, "FAIL", "virtualization", "GPU 0");
    assert!(
        v.contains("nvdra says bare metal, nvidia-smi a passthrough VM"),
        "{v}"
    );
    let s = line_with(&report, "FAIL", "settings", "GPU 0");
    assert!(
        s.contains("before MIG Disabled (pending Disabled)")
            && s.contains("after MIG Disabled (pending Enabled)"),
        "{s}"
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("mig-readonly: 4 check(s) failed"),
        "{}",
        text(&out)
    );
}

#[test]
fn the_mig_check_records_a_silent_nvidia_smi_and_skips_nvml_without_python() {
    // Drivers whose `nvidia-smi mig` answers nothing with MIG off, and no Python for ctypes.
    let node = MigNode::new("None");
    node.write("lgip.txt", "No MIG-enabled devices found.\n");
    node.write("lgipp.txt", "No MIG-enabled devices found.\n");
    node.write("mig.rc", "6");
    let (out, report) = node.run(&[("PYTHON", "/nonexistent/python3")]);
    assert!(out.status.success(), "{}", text(&out));
    for flag in ["-lgip", "-lgipp"] {
        line_with(
            &report,
            "INFO",
            "placements",
            &format!(
                "nvidia-smi mig {flag} does not answer with MIG Disabled (exit 6: No MIG-enabled devices found.)"
            ),
        );
    }
    line_with(
        &report,
        "INFO",
        "placements",
        "no NVML answer to compare nvdra's tables with",
    );
    assert!(
        lines_of(&report, "PASS", "placements").is_empty(),
        "{report}"
    );
    line_with(&report, "SKIP", "events", "skipped, no python");
    line_with(&report, "SKIP", "timing", "skipped, no python");
    // nvidia-smi alone still tells the virtualization mode.
    line_with(
        &report,
        "PASS",
        "virtualization",
        "(nvidia-smi -q: None; NVML: not read; nvdra: bareMetal)",
    );
}

#[test]
fn the_nvml_probe_calls_no_setter() {
    // Every NVML function the probe names reads, or is its own event set's.
    let probe = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/device/nvml_probe.py"
    ))
    .unwrap();
    let mut names: Vec<&str> = probe
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("nvml") && w.len() > 4)
        .collect();
    names.sort_unstable();
    names.dedup();
    assert!(names.contains(&"nvmlDeviceGetMigMode"), "{names:?}");
    for name in names {
        let own_event_set = name.starts_with("nvmlEventSet") || name == "nvmlDeviceRegisterEvents";
        let changes = [
            "Set", "Create", "Destroy", "Reset", "Clear", "Enable", "Disable",
        ]
        .iter()
        .any(|w| name.contains(w));
        assert!(own_event_set || !changes, "the probe calls {name}");
    }
}
