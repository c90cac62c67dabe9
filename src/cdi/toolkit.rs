//! The version of the node's NVIDIA Container Toolkit, read from the hook binary nvdra names in
//! every spec, and the versions below which some of its hooks are left out.
//!
//! NVIDIA Container Toolkit 1.17.7 and older have CVE-2025-23266 (`enable-cuda-compat`: a
//! container image can make the hook, run as root on the host, load a library of its own) and
//! CVE-2025-23267 (`update-ldcache` follows links out of the container); 1.17.8 fixes both. So
//! the spec carries `enable-cuda-compat` and `update-ldcache` only when the hook binary reports
//! 1.17.8 or later ([`HookCheck::allows`]); the other hooks stay. An unreadable version (the
//! binary cannot be run in nvdra's container, hangs, prints too much or something else than
//! NVIDIA's format, or was built without a version) counts as below the floor: nvdra cannot
//! tell, and the hooks run as root on the host.
//!
//! The version also says which hooks the binary has: `disable-device-node-modification` came
//! in 1.18.0, and an older binary fails it (urfave/cli's "No help topic", exit status 3), which
//! fails every container's start; so it too is carried only from that version on ([`MINIMUM`]).
//!
//! How the version is read: the binary nvdra already writes into every spec (which the runtime
//! runs as root on the host for every container anyway) is run with `--version` only: no shell,
//! an empty environment, `/` as its directory, no input, killed at [`DEADLINE`] and as soon as
//! it writes more than [`crate::child::OUTPUT_LIMIT`] (through [`crate::child`]). Its answer
//! must be NVIDIA's format
//! (urfave/cli's `<name> version <version>` over `internal/info`'s version string), e.g.
//!
//! ```text
//! NVIDIA CDI Hook version 1.17.8
//! commit: f202b80a…
//! ```
//!
//! with `NVIDIA Container Toolkit CLI` as the name for `nvidia-ctk`. NVIDIA's toolkit installer
//! (GPU Operator, 1.17.x to 1.19.x) installs `nvidia-cdi-hook` and `nvidia-ctk` as `/bin/sh`
//! wrappers that run `<name>.real` beside them; nvdra's image has no shell, so for such a
//! wrapper the `.real` binary it runs is asked instead.
//!
//! Each binary is checked once per file (path, inode, size, modification time): discovery runs
//! again (the device-plugin spec at each write, the claim specs until the driver is found), and
//! an upgraded toolkit is checked again when discovery next runs.

use std::collections::BTreeMap;
use std::fmt;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

/// The first toolkit version without CVE-2025-23266 and CVE-2025-23267.
pub const FIXED: ToolkitVersion = ToolkitVersion {
    major: 1,
    minor: 17,
    patch: 8,
    pre: None,
};
/// The hooks left out below [`FIXED`].
pub const GUARDED_HOOKS: [&str; 2] = ["enable-cuda-compat", "update-ldcache"];
/// The first toolkit whose hook binary has `disable-device-node-modification`: an older one
/// answers the subcommand with "No help topic" and exit status 3, which fails the container.
pub const DEVICE_NODE_HOOK_SINCE: ToolkitVersion = ToolkitVersion {
    major: 1,
    minor: 18,
    patch: 0,
    pre: None,
};
/// Each hook the spec carries only from a toolkit version on: the two of [`GUARDED_HOOKS`] from
/// [`FIXED`], `disable-device-node-modification` from the release that has it. Any other hook
/// (`create-symlinks`) is in every toolkit that has `nvidia-cdi-hook`.
pub const MINIMUM: [(&str, ToolkitVersion); 3] = [
    (GUARDED_HOOKS[0], FIXED),
    (GUARDED_HOOKS[1], FIXED),
    ("disable-device-node-modification", DEVICE_NODE_HOOK_SINCE),
];
/// The CVEs [`FIXED`] fixes, as the warning and the README name them.
pub const CVES: &str = "CVE-2025-23266, CVE-2025-23267";
/// How long `--version` may take: a Go binary answers in milliseconds.
pub const DEADLINE: Duration = Duration::from_secs(5);
/// How much of a hook file is read to tell one of NVIDIA's installer wrappers (under 1 KiB).
const WRAPPER_HEAD: u64 = 4096;
/// The names urfave/cli prints before ` version ` for each hook binary.
const NAMES: [(&str, &str); 2] = [
    ("nvidia-cdi-hook", "NVIDIA CDI Hook"),
    ("nvidia-ctk", "NVIDIA Container Toolkit CLI"),
];

/// A toolkit version as NVIDIA's Makefile stamps it: `<major>.<minor>.<patch>`, with
/// `-<tag>` for a release candidate (`1.18.0-rc.1`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolkitVersion {
    pub major: u64,
    pub minor: u64,
    pub patch: u64,
    pub pre: Option<String>,
}

impl ToolkitVersion {
    /// `1.17.8`, `1.18.0-rc.1`; anything else (`unknown`, `v1.17.8`, `1.17`) is `None`.
    pub fn parse(text: &str) -> Option<Self> {
        let (release, pre) = match text.split_once('-') {
            Some((r, tag)) => {
                let ok = !tag.is_empty()
                    && tag
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-');
                if !ok {
                    return None;
                }
                (r, Some(tag.to_string()))
            }
            None => (text, None),
        };
        let mut parts = release.split('.').map(|p| {
            (!p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
                .then(|| p.parse::<u64>().ok())
                .flatten()
        });
        let (Some(Some(major)), Some(Some(minor)), Some(Some(patch)), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return None;
        };
        Some(Self {
            major,
            minor,
            patch,
            pre,
        })
    }

    /// Whether this version is `release` or later; a release candidate of `release` comes
    /// before it (`release` is a release, without a tag).
    pub fn at_least(&self, release: &ToolkitVersion) -> bool {
        let this = (self.major, self.minor, self.patch);
        let that = (release.major, release.minor, release.patch);
        this > that || (this == that && self.pre.is_none())
    }

    /// Whether this version has the fixes of [`FIXED`].
    pub fn is_fixed(&self) -> bool {
        self.at_least(&FIXED)
    }
}

impl fmt::Display for ToolkitVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)?;
        match &self.pre {
            Some(tag) => write!(f, "-{tag}"),
            None => Ok(()),
        }
    }
}

/// What nvdra knows of a hook binary's version.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum HookCheck {
    /// Never asked (driver files put together by hand): treated as unreadable.
    #[default]
    Unchecked,
    /// The binary reported this version.
    Version(ToolkitVersion),
    /// Why the version could not be read.
    Unreadable(String),
}

impl HookCheck {
    /// Whether the spec may carry `hook` (a hook's subcommand name): one of [`MINIMUM`] only
    /// when the version is read and at least its minimum, any other always.
    pub fn allows(&self, hook: &str) -> bool {
        match MINIMUM.iter().find(|(h, _)| *h == hook) {
            Some((_, since)) => matches!(self, Self::Version(v) if v.at_least(since)),
            None => true,
        }
    }

    /// Whether the binary reported [`FIXED`] or later.
    pub fn is_fixed(&self) -> bool {
        matches!(self, Self::Version(v) if v.is_fixed())
    }

    /// The version as `/metrics` labels it: the version, or `unreadable`.
    pub fn version_label(&self) -> String {
        match self {
            Self::Version(v) => v.to_string(),
            Self::Unchecked | Self::Unreadable(_) => "unreadable".into(),
        }
    }

    /// Each hook of [`MINIMUM`] the spec leaves out, and why in a few words (`/metrics` labels
    /// it; the start-up log has the details): `toolkit 1.17.7 below 1.17.8`.
    pub fn left_out(&self) -> Vec<(&'static str, String)> {
        MINIMUM
            .iter()
            .filter(|(hook, _)| !self.allows(hook))
            .map(|(hook, since)| {
                let why = match self {
                    Self::Version(v) => format!("toolkit {v} below {since}"),
                    Self::Unchecked => "toolkit version not read".into(),
                    Self::Unreadable(_) => "toolkit version unreadable".into(),
                };
                (*hook, why)
            })
            .collect()
    }
}

/// Parses what `<binary> --version` printed: NVIDIA's first line `<name> version <version>`,
/// the name being the one `binary` (`nvidia-cdi-hook`, `nvidia-ctk`) prints.
pub fn parse_version_output(binary: &str, output: &str) -> Result<ToolkitVersion, String> {
    let name = NAMES
        .iter()
        .find(|(b, _)| *b == binary)
        .map(|(_, n)| *n)
        .ok_or_else(|| format!("{binary:?} is not a hook binary nvdra knows the output of"))?;
    let first = output.lines().next().unwrap_or_default().trim_end();
    let version = first
        .strip_prefix(name)
        .and_then(|rest| rest.strip_prefix(" version "))
        .ok_or_else(|| {
            format!("its --version printed {first:?}, not NVIDIA's \"{name} version <version>\"")
        })?;
    ToolkitVersion::parse(version).ok_or_else(|| {
        format!("its --version names version {version:?}, not <major>.<minor>.<patch>")
    })
}

/// The file nvdra runs to read `hook`'s version (a read path): `hook` itself, or for one of
/// NVIDIA's installer wrappers (a script naming `<name>.real`, with that file beside it) the
/// binary the wrapper runs.
fn version_binary(hook: &Path) -> PathBuf {
    let mut head = Vec::new();
    let read = std::fs::File::open(hook)
        .and_then(|f| f.take(WRAPPER_HEAD).read_to_end(&mut head))
        .is_ok();
    let Some(name) = hook.file_name().and_then(|n| n.to_str()) else {
        return hook.to_path_buf();
    };
    let real_name = format!("{name}.real");
    let real = hook.with_file_name(&real_name);
    let names_real = String::from_utf8_lossy(&head).contains(&real_name);
    if read && head.starts_with(b"#!") && names_real && real.is_file() {
        real
    } else {
        hook.to_path_buf()
    }
}

/// Runs `binary --version` as the module docs say and returns what it printed.
fn run_version(binary: &Path, deadline: Duration) -> Result<String, String> {
    const TEXT_BUSY: i32 = 26; // ETXTBSY on Linux
    let name = format!("{} --version", binary.display());
    let mut tries = 0;
    let out = loop {
        let mut cmd = Command::new(binary);
        cmd.arg("--version").env_clear().current_dir("/");
        match crate::child::output(&mut cmd, &name, deadline) {
            // A binary open for writing elsewhere at that moment (an installer replacing it, or
            // a process forked while a file was open for writing) is tried again a few times.
            Err(crate::child::Error::Spawn { source, .. })
                if source.raw_os_error() == Some(TEXT_BUSY) && tries < 5 =>
            {
                tries += 1;
                std::thread::sleep(Duration::from_millis(20 * tries));
            }
            Err(e) => return Err(crate::report::chain(&e).to_string()),
            Ok(out) => break out,
        }
    };
    if !out.status.success() {
        return Err(format!("{name} ended with {}", out.status));
    }
    String::from_utf8(out.stdout).map_err(|_| format!("{name} printed something not UTF-8"))
}

/// `hook`'s version (`hook`: where nvdra reads the binary; its file name says which binary it
/// is), read by running it (see the module docs) under `deadline`.
pub fn check_hook_with(hook: &Path, deadline: Duration) -> HookCheck {
    let binary = hook
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    match run_version(&version_binary(hook), deadline)
        .and_then(|out| parse_version_output(binary, &out))
    {
        Ok(v) => HookCheck::Version(v),
        Err(why) => HookCheck::Unreadable(why),
    }
}

/// A file's identity: a replaced or rewritten binary is checked again.
type FileId = (u64, u64, u64, i64, i64);

fn file_id(path: &Path) -> Option<FileId> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
}

/// What each hook binary was found to be, by read path, and the one discovery found last.
#[derive(Default)]
struct Checked {
    by_path: BTreeMap<PathBuf, (Option<FileId>, HookCheck)>,
    last: Option<(PathBuf, HookCheck)>,
}

static CHECKED: Mutex<Checked> = Mutex::new(Checked {
    by_path: BTreeMap::new(),
    last: None,
});

/// `hook`'s version, read once per file (see the module docs) and logged when first read: a
/// warning when the guarded hooks are left out. `host` is the path the specs name.
pub(super) fn check_hook(hook: &Path, host: &Path) -> HookCheck {
    let id = file_id(hook);
    let known = crate::lock::lock(&CHECKED)
        .by_path
        .get(hook)
        .filter(|(seen, _)| id.is_some() && *seen == id)
        .map(|(_, check)| check.clone());
    let check = match known {
        Some(check) => check,
        None => {
            // Not under the lock: a child process, under its deadline.
            let check = check_hook_with(hook, DEADLINE);
            log(host, &check);
            crate::lock::lock(&CHECKED)
                .by_path
                .insert(hook.to_path_buf(), (id, check.clone()));
            check
        }
    };
    crate::lock::lock(&CHECKED).last = Some((host.to_path_buf(), check.clone()));
    check
}

/// The hook binary discovery found last (its host path) and its version, for `/metrics`.
pub fn last_check() -> Option<(PathBuf, HookCheck)> {
    crate::lock::lock(&CHECKED).last.clone()
}

fn log(host: &Path, check: &HookCheck) {
    let hooks = GUARDED_HOOKS.join(" and ");
    match check {
        HookCheck::Version(v) if v.at_least(&DEVICE_NODE_HOOK_SINCE) => tracing::info!(
            hook.path = %host.display(),
            toolkit.version = %v,
            "NVIDIA Container Toolkit {v}: CDI specs carry all of NVIDIA's hooks"
        ),
        HookCheck::Version(v) if v.is_fixed() => tracing::info!(
            hook.path = %host.display(),
            toolkit.version = %v,
            "NVIDIA Container Toolkit {v} has no disable-device-node-modification hook (it came \
             in {DEVICE_NODE_HOOK_SINCE}; a hook the binary lacks would fail every container's \
             start): CDI specs leave it out, so NVML in a container may create device nodes there"
        ),
        HookCheck::Version(v) => tracing::warn!(
            hook.path = %host.display(),
            toolkit.version = %v,
            "NVIDIA Container Toolkit {v} is below {FIXED}, which fixes {CVES} (a container \
             image can make enable-cuda-compat load its own library as root on the host, and \
             update-ldcache follows links out of the container): CDI specs leave out {hooks} \
             (containers get no CUDA forward compatibility and no ld cache entries for the \
             driver's libraries), and disable-device-node-modification, which it lacks; upgrade \
             the NVIDIA Container Toolkit on this node to {FIXED} or later ({DEVICE_NODE_HOOK_SINCE} \
             for all four hooks) and restart nvdra"
        ),
        HookCheck::Unchecked | HookCheck::Unreadable(_) => {
            let why = match check {
                HookCheck::Unreadable(why) => why.as_str(),
                _ => "not read",
            };
            tracing::warn!(
                hook.path = %host.display(),
                reason = %why,
                "cannot read the NVIDIA Container Toolkit version of {}, so it is treated as \
                 below {FIXED}, which fixes {CVES}: CDI specs leave out {hooks} (containers get \
                 no CUDA forward compatibility and no ld cache entries for the driver's \
                 libraries) and disable-device-node-modification; install NVIDIA Container \
                 Toolkit {FIXED} or later (its `--version` prints \"<name> version <version>\") \
                 and restart nvdra",
                host.display()
            )
        }
    }
}
