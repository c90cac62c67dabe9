//! A real container engine for CDI tests: podman, runc and a busybox image imported from a
//! local root filesystem, for the CDI tests of the integration binary (`support::podman`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use anyhow::{Context, Result, bail, ensure};
use nvdra::cdi::{self, CdiOptions, PreparedDevice};
use nvdra::ids::ClaimUid;

pub const IMAGE: &str = "localhost/cdi-test:latest";
/// Where podman versions without `--cdi-spec-dir` read specs (the other is `/etc/cdi`).
pub const SYSTEM_CDI_DIR: &str = "/var/run/cdi";
/// Generous bound on one podman command, so a wedged engine fails the test instead of hanging it.
pub const PODMAN_TIMEOUT_S: &str = "180";

pub use super::require;

pub fn required() -> bool {
    require::required("NVDRA_REQUIRE_PODMAN")
}

/// Runs `check` against the engine, or skips (or fails, when required) without one. The engine
/// is probed once per test binary, so parallel tests do not import the image twice.
pub fn with_engine(check: impl FnOnce(&Engine) -> Result<()>) {
    static ENGINE: OnceLock<Result<Engine, String>> = OnceLock::new();
    let required = required();
    match ENGINE.get_or_init(|| engine().map_err(|e| format!("{e:#}"))) {
        Ok(engine) => check(engine).unwrap_or_else(|e| panic!("{e:#}")),
        Err(why) if required => {
            panic!("NVDRA_REQUIRE_PODMAN is set but podman cannot run containers here: {why}")
        }
        Err(why) => eprintln!(
            "skipping the podman CDI test: {why} (set NVDRA_REQUIRE_PODMAN=1 to make this a failure)"
        ),
    }
}

/// A podman that can run the test image, and how to point it at a spec directory.
pub struct Engine {
    /// Podman 4.4+ takes `--cdi-spec-dir`; older ones read only the system directories.
    pub has_spec_dir_flag: bool,
}

pub fn podman(global: &[&str], args: &[&str]) -> Result<Output> {
    Command::new("timeout")
        .arg(PODMAN_TIMEOUT_S)
        .arg("podman")
        .args(["--runtime", "runc", "--cgroup-manager=cgroupfs"])
        .args(global)
        .args(args)
        .output()
        .context("cannot start podman (through timeout)")
}

impl Engine {
    /// Runs `sh -c script` in the test image with the CDI device `device`, its spec read from
    /// `cdi_root` (where this podman can be told a spec directory; else the system's).
    pub fn run_with_device(&self, cdi_root: &Path, device: &str, script: &str) -> Result<Output> {
        let dir_arg = cdi_root.display().to_string();
        let global: Vec<&str> = if self.has_spec_dir_flag {
            vec!["--cdi-spec-dir", &dir_arg]
        } else {
            vec![]
        };
        podman(
            &global,
            &[
                "run",
                "--rm",
                "--network",
                "none",
                "--device",
                device,
                IMAGE,
                "sh",
                "-c",
                script,
            ],
        )
    }
}

pub fn ok(out: &Output, what: &str) -> Result<String> {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success(),
        "{what} failed ({}): {}{}",
        out.status,
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(stdout)
}

/// Checks podman is installed and can run a plain container of the test image (importing the
/// image once). Any error here means "the engine cannot run", not "the spec is wrong".
pub fn engine() -> Result<Engine> {
    let version = Command::new("podman")
        .arg("--version")
        .output()
        .context("podman is not installed (apt-get install podman runc busybox-static)")?;
    ok(&version, "podman --version")?;
    let help = ok(
        &Command::new("podman").arg("--help").output()?,
        "podman --help",
    )?;
    let has_spec_dir_flag = help.contains("--cdi-spec-dir");

    let exists = podman(&[], &["image", "exists", IMAGE])?;
    if !exists.status.success() {
        import_image()?;
    }
    let smoke = podman(
        &[],
        &[
            "run",
            "--rm",
            "--network",
            "none",
            IMAGE,
            "sh",
            "-c",
            "echo ok",
        ],
    )?;
    let out = ok(&smoke, "a plain podman run")?;
    ensure!(out.trim() == "ok", "a plain podman run printed {out:?}");
    Ok(Engine { has_spec_dir_flag })
}

/// Builds a busybox root filesystem and imports it as the test image (no registry needed).
pub fn import_image() -> Result<()> {
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.is_file())
        .context("busybox not found (apt-get install busybox-static)")?;
    let dir = tempfile::tempdir()?;
    let rootfs = dir.path().join("rootfs");
    std::fs::create_dir_all(rootfs.join("bin"))?;
    for d in ["dev", "proc", "sys", "tmp", "etc", "usr/bin", "usr/lib"] {
        std::fs::create_dir_all(rootfs.join(d))?;
    }
    std::fs::copy(busybox, rootfs.join("bin/busybox"))?;
    for applet in ["sh", "ls", "cat", "env", "test", "echo"] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet))?;
    }
    let tar = dir.path().join("rootfs.tar");
    let out = Command::new("tar")
        .arg("-C")
        .arg(&rootfs)
        .arg("-cf")
        .arg(&tar)
        .arg(".")
        .output()?;
    ok(&out, "tar of the test rootfs")?;
    let out = podman(&[], &["import", &tar.display().to_string(), IMAGE])?;
    ok(&out, "podman import")?;
    Ok(())
}

/// Removes the spec on drop, so a failing test leaves nothing in the system CDI directory.
pub struct SpecGuard {
    pub cdi_root: PathBuf,
    pub opts: CdiOptions,
    pub claim_uid: ClaimUid,
}

impl Drop for SpecGuard {
    fn drop(&mut self) {
        if let Err(e) = cdi::remove_spec(
            &self.cdi_root,
            &self.opts,
            &self.claim_uid,
            nvdra::durable::Durability::Atomic,
        ) {
            eprintln!("cannot remove the test CDI spec: {e}");
        }
    }
}

pub fn mknod(path: &Path) -> Result<()> {
    std::fs::create_dir_all(path.parent().context("device path has a parent")?)?;
    let out = Command::new("mknod")
        .arg(path)
        .args(["c", "1", "3"])
        .output()
        .context("cannot run mknod")?;
    ok(&out, &format!("mknod {} (needs root)", path.display()))?;
    Ok(())
}

/// Checks `node` is listed by `ls -l` in `output` as the char device 1:3 (what `mknod` made).
pub fn assert_null_node(output: &str, node: &str) -> Result<()> {
    let line = output
        .lines()
        .find(|l| l.ends_with(&format!(" {node}")))
        .with_context(|| format!("{node} missing in the container:\n{output}"))?;
    ensure!(
        line.starts_with('c') && line.contains("1,") && line.contains(" 3 "),
        "{node} is not the char device 1:3 in the container: {line}"
    );
    Ok(())
}

pub fn assert_line(output: &str, line: &str) -> Result<()> {
    if output.lines().any(|l| l == line) {
        Ok(())
    } else {
        bail!("expected the line {line:?} in the container output:\n{output}")
    }
}

/// Writes the claim's spec where the engine reads it, runs `script` in a container given the
/// CDI ids of `devices`, and returns its output; the spec is removed afterwards.
pub fn run_claim(
    engine: &Engine,
    opts: &CdiOptions,
    devices: &[PreparedDevice],
    files: &cdi::DriverFiles,
    script: &str,
) -> Result<String> {
    run_claim_with(engine, opts, devices, files, script, |_| {})
}

/// [`run_claim`], with `edit` applied to the spec before podman reads it.
pub fn run_claim_with(
    engine: &Engine,
    opts: &CdiOptions,
    devices: &[PreparedDevice],
    files: &cdi::DriverFiles,
    script: &str,
    edit: impl FnOnce(&mut cdi::Spec),
) -> Result<String> {
    let claim_uid = format!("nvdra-podman-test-{:016x}", rand::random::<u64>());
    let mut spec = cdi::claim_spec(opts, &claim_uid, devices, files)?;
    edit(&mut spec);
    let claim_uid = ClaimUid::parse(claim_uid)?;
    let spec_dir = tempfile::tempdir()?;
    let cdi_root = if engine.has_spec_dir_flag {
        spec_dir.path().to_path_buf()
    } else {
        PathBuf::from(SYSTEM_CDI_DIR)
    };
    let _guard = SpecGuard {
        cdi_root: cdi_root.clone(),
        opts: opts.clone(),
        claim_uid: claim_uid.clone(),
    };
    cdi::write_spec(
        &cdi_root,
        opts,
        &claim_uid,
        &spec,
        nvdra::durable::Durability::Atomic,
    )?;

    let dir_arg = cdi_root.display().to_string();
    let global: Vec<&str> = if engine.has_spec_dir_flag {
        vec!["--cdi-spec-dir", &dir_arg]
    } else {
        vec![]
    };
    let ids: Vec<String> = devices
        .iter()
        .map(|d| cdi::device_id(opts, claim_uid.as_str(), &d.name))
        .collect();
    let mut args = vec!["run", "--rm", "--network", "none"];
    for id in &ids {
        args.extend(["--device", id.as_str()]);
    }
    args.extend([IMAGE, "sh", "-c", script]);
    let out = podman(&global, &args)?;
    let stdout = ok(
        &out,
        &format!("podman run --device {}", ids.join(" --device ")),
    )
    .with_context(|| format!("the spec was:\n{}", spec.to_yaml().unwrap_or_default()))?;
    eprintln!("container output:\n{stdout}");
    Ok(stdout)
}
