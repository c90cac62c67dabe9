//! The toolkit floor: NVIDIA's `--version` format read from stand-in hook binaries on both sides
//! of 1.17.8 (and ones that hang, flood, print garbage or cannot run), and the claim spec's
//! hooks with and without `enable-cuda-compat` and `update-ldcache`.

use std::time::Duration;

use super::*;
use crate::cdi::toolkit::{
    FIXED, HookCheck, ToolkitVersion, check_hook, check_hook_with, parse_version_output,
};

/// Long enough for any shell script on a loaded machine; the hung stand-in gets less.
const PATIENT: Duration = Duration::from_secs(60);

fn v(text: &str) -> ToolkitVersion {
    ToolkitVersion::parse(text).unwrap_or_else(|| panic!("{text} parses"))
}

#[test]
fn versions_parse_as_nvidias_makefile_stamps_them() {
    assert_eq!(
        v("1.17.8"),
        ToolkitVersion {
            major: 1,
            minor: 17,
            patch: 8,
            pre: None
        }
    );
    assert_eq!(v("1.18.0-rc.1").pre.as_deref(), Some("rc.1"));
    assert_eq!(v("1.18.0-rc.1").to_string(), "1.18.0-rc.1");
    assert_eq!(FIXED.to_string(), "1.17.8");
    // Built without the Makefile's -X flags, a tag's `v`, too few or too many parts, signs,
    // spaces, an empty tag.
    for bad in [
        "unknown", "v1.17.8", "1.17", "1.17.8.1", "1.17.-8", "+1.17.8", "1.17.8 ", "1.17.8-", "",
        "1..8", "1.17.x",
    ] {
        assert_eq!(ToolkitVersion::parse(bad), None, "{bad:?}");
    }
}

#[test]
fn only_1_17_8_and_later_are_fixed() {
    for fixed in [
        "1.17.8",
        "1.17.9",
        "1.18.0",
        "1.18.0-rc.1",
        "1.19.0",
        "1.19.1",
        "1.20.0-rc.1",
        "2.0.0",
    ] {
        assert!(v(fixed).is_fixed(), "{fixed}");
    }
    // Numbers, not text: 1.9 comes before 1.17. A release candidate of 1.17.8 comes before it.
    for vulnerable in [
        "1.17.7",
        "1.17.0",
        "1.16.2",
        "1.9.99",
        "0.18.0",
        "1.17.8-rc.1",
    ] {
        assert!(!v(vulnerable).is_fixed(), "{vulnerable}");
    }
}

#[test]
fn each_conditional_hook_is_allowed_only_from_its_version() {
    let below = HookCheck::Version(v("1.17.7"));
    let fixed = HookCheck::Version(v("1.17.8"));
    let rc = HookCheck::Version(v("1.18.0-rc.3"));
    let all = HookCheck::Version(v("1.18.0"));
    let unreadable = HookCheck::Unreadable("cannot run it".into());
    let allowed = |check: &HookCheck| -> Vec<&str> {
        [
            "create-symlinks",
            "enable-cuda-compat",
            "update-ldcache",
            "disable-device-node-modification",
        ]
        .into_iter()
        .filter(|h| check.allows(h))
        .collect()
    };
    for check in [&below, &unreadable, &HookCheck::Unchecked] {
        assert_eq!(allowed(check), ["create-symlinks"], "{check:?}");
    }
    // 1.17.8 has the fixes but not disable-device-node-modification, which came in 1.18.0.
    for check in [&fixed, &rc] {
        assert_eq!(
            allowed(check),
            ["create-symlinks", "enable-cuda-compat", "update-ldcache"],
            "{check:?}"
        );
    }
    assert_eq!(allowed(&all).len(), 4);
    let left = |check: &HookCheck| -> Vec<(String, String)> {
        check
            .left_out()
            .into_iter()
            .map(|(h, why)| (h.to_string(), why))
            .collect()
    };
    let pair = |h: &str, why: &str| (h.to_string(), why.to_string());
    assert_eq!(
        left(&below),
        [
            pair("enable-cuda-compat", "toolkit 1.17.7 below 1.17.8"),
            pair("update-ldcache", "toolkit 1.17.7 below 1.17.8"),
            pair(
                "disable-device-node-modification",
                "toolkit 1.17.7 below 1.18.0"
            ),
        ]
    );
    assert_eq!(
        left(&fixed),
        [pair(
            "disable-device-node-modification",
            "toolkit 1.17.8 below 1.18.0"
        )]
    );
    assert_eq!(
        left(&unreadable)[0],
        pair("enable-cuda-compat", "toolkit version unreadable")
    );
    assert_eq!(left(&unreadable).len(), 3);
    assert_eq!(left(&all), []);
    assert_eq!(below.version_label(), "1.17.7");
    assert_eq!(unreadable.version_label(), "unreadable");
}

#[test]
fn the_version_output_is_read_in_nvidias_format_only() {
    let read = |binary: &str, out: &str| parse_version_output(binary, out);
    assert_eq!(
        read(
            "nvidia-cdi-hook",
            &version_output("nvidia-cdi-hook", "1.17.8")
        ),
        Ok(v("1.17.8"))
    );
    assert_eq!(
        read("nvidia-ctk", &version_output("nvidia-ctk", "1.17.7")),
        Ok(v("1.17.7"))
    );
    // Without a commit line (built without GIT_COMMIT) and with CRLF.
    assert_eq!(
        read("nvidia-cdi-hook", "NVIDIA CDI Hook version 1.19.0\r\n"),
        Ok(v("1.19.0"))
    );
    let refused = |binary: &str, out: &str, says: &str| {
        let e = read(binary, out).unwrap_err();
        assert!(e.contains(says), "{out:?}: {e}");
    };
    // The other binary's name, garbage, nothing, a version the Makefile did not stamp.
    refused(
        "nvidia-cdi-hook",
        &version_output("nvidia-ctk", "1.17.8"),
        "not NVIDIA's \"NVIDIA CDI Hook version <version>\"",
    );
    refused("nvidia-cdi-hook", "hello\n", "printed \"hello\"");
    refused("nvidia-cdi-hook", "", "printed \"\"");
    refused(
        "nvidia-cdi-hook",
        "NVIDIA CDI Hook version unknown\n",
        "names version \"unknown\"",
    );
    refused(
        "nvidia-cdi-hook",
        "commit: abc\nNVIDIA CDI Hook version 1.17.8\n",
        "printed \"commit: abc\"",
    );
    refused(
        "runc",
        "runc version 1.2.0\n",
        "\"runc\" is not a hook binary",
    );
}

/// Stand-in binaries on both sides of the fix, and ones whose version cannot be read.
#[test]
fn fake_hook_binaries_on_both_sides_of_the_fix() {
    let host = Host::new();
    let check = |path: &Path| check_hook_with(path, PATIENT);
    for (version, fixed) in [
        ("1.17.7", false),
        ("1.17.8", true),
        ("1.18.0", true),
        ("1.19.0", true),
        ("1.19.1", true),
    ] {
        for binary in ["nvidia-cdi-hook", "nvidia-ctk"] {
            let path = host.hook(&format!("{version}/{binary}"), version);
            let found = check(&path);
            assert_eq!(found, HookCheck::Version(v(version)), "{binary} {version}");
            assert_eq!(found.is_fixed(), fixed, "{binary} {version}");
        }
    }
    let unreadable = |path: &Path, says: &str| match check(path) {
        HookCheck::Unreadable(why) => assert!(why.contains(says), "{}: {why}", path.display()),
        other => panic!("{}: {other:?}", path.display()),
    };
    unreadable(
        &host.script("garbage/nvidia-cdi-hook", "echo 'usage: something else'"),
        "printed \"usage: something else\"",
    );
    unreadable(
        &host.script(
            "failing/nvidia-cdi-hook",
            &format!(
                "printf '%s' '{}'; exit 1",
                version_output("nvidia-cdi-hook", "1.19.1")
            ),
        ),
        "ended with exit status: 1",
    );
    // Not executable: the runtime could not run it either.
    unreadable(&host.file("plain/nvidia-cdi-hook"), "cannot run");
    unreadable(&host.root().join("absent/nvidia-cdi-hook"), "cannot run");
    unreadable(
        &host.script("binary/nvidia-cdi-hook", "printf '\\377\\376\\n'"),
        "not UTF-8",
    );
    // Floods its output: killed at the child runner's cap, whatever it would have printed last.
    unreadable(
        &host.script(
            "flood/nvidia-cdi-hook",
            &format!(
                "while :; do echo xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx; done; printf '%s' '{}'",
                version_output("nvidia-cdi-hook", "1.19.1")
            ),
        ),
        &format!("more than {} bytes", crate::child::OUTPUT_LIMIT),
    );
}

/// A hung binary is killed at the deadline: its version is unreadable.
#[test]
fn a_hung_hook_binary_is_killed_at_its_deadline() {
    let host = Host::new();
    let hung = host.script("hung/nvidia-cdi-hook", "exec sleep 600");
    match check_hook_with(&hung, Duration::from_millis(200)) {
        HookCheck::Unreadable(why) => assert!(why.contains("did not finish within"), "{why}"),
        other => panic!("{other:?}"),
    }
}

/// Only `--version`, no environment (no `LD_PRELOAD`, no `HOME`), `/` as its directory.
#[test]
fn the_hook_runs_with_only_version_no_environment_and_root_as_its_directory() {
    let host = Host::new();
    let strict = host.script(
        "strict/nvidia-cdi-hook",
        &format!(
            "[ \"$#\" = 1 ] && [ \"$1\" = --version ] || exit 2\n\
             [ -z \"$HOME$LD_PRELOAD$LD_LIBRARY_PATH$NVDRA_LOG\" ] || exit 3\n\
             [ \"$(pwd)\" = / ] || exit 4\n\
             printf '%s' '{}'",
            version_output("nvidia-cdi-hook", "1.18.0")
        ),
    );
    assert_eq!(
        check_hook_with(&strict, PATIENT),
        HookCheck::Version(v("1.18.0"))
    );
}

/// The GPU Operator's toolkit installer (1.17.x to 1.19.x) installs `nvidia-cdi-hook` as a
/// `/bin/sh` wrapper running `nvidia-cdi-hook.real`: the `.real` binary is asked (nvdra's image
/// has no shell; here the wrapper names the host path, which this machine does not have).
#[test]
fn an_installer_wrapper_is_read_through_its_real_binary() {
    let host = Host::new();
    let dir = "usr/local/nvidia/toolkit";
    let wrapper = host.script(
        &format!("{dir}/nvidia-cdi-hook"),
        "PATH=/usr/local/nvidia/toolkit:$PATH \\\n\t/usr/local/nvidia/toolkit/nvidia-cdi-hook.real \\\n\t\t\"$@\"",
    );
    host.hook(&format!("{dir}/nvidia-cdi-hook.real"), "1.17.8");
    assert_eq!(
        check_hook_with(&wrapper, PATIENT),
        HookCheck::Version(v("1.17.8"))
    );
    // A script beside no `.real` is run itself.
    let lone = host.script(
        "lone/nvidia-cdi-hook",
        "exec /usr/local/nvidia/toolkit/nvidia-cdi-hook.real \"$@\"",
    );
    assert!(matches!(
        check_hook_with(&lone, PATIENT),
        HookCheck::Unreadable(_)
    ));
}

/// Checked once per file: discovery again reads the answer kept; a replaced binary is asked
/// again.
#[test]
fn a_hook_binary_is_asked_once_until_it_changes() {
    let host = Host::new();
    let count = host.root().join("asked");
    let body = |version: &str| {
        format!(
            "echo x >> {}\nprintf '%s' '{}'",
            count.display(),
            version_output("nvidia-cdi-hook", version)
        )
    };
    let path = host.script("usr/bin/nvidia-cdi-hook", &body("1.17.7"));
    let asked = || {
        fs::read_to_string(&count)
            .unwrap_or_default()
            .lines()
            .count()
    };
    assert_eq!(check_hook(&path, &path), HookCheck::Version(v("1.17.7")));
    assert_eq!(check_hook(&path, &path), HookCheck::Version(v("1.17.7")));
    assert_eq!(asked(), 1);
    // The toolkit upgraded in place (another size, another inode).
    let new = host.root().join("usr/bin/.new");
    fs::write(&new, format!("#!/bin/sh\n{}\n", body("1.17.10"))).unwrap();
    fs::set_permissions(&new, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    fs::rename(&new, &path).unwrap();
    assert_eq!(check_hook(&path, &path), HookCheck::Version(v("1.17.10")));
    assert_eq!(asked(), 2);
}

/// The spec-wide hooks' names (`args[1]`, after the binary's name; `nvidia-ctk`'s `hook` skipped).
fn hook_names(spec: &Spec) -> Vec<String> {
    spec.container_edits
        .hooks
        .iter()
        .map(|h| {
            let skip = if h.args[0] == "nvidia-ctk" { 2 } else { 1 };
            h.args[skip].clone()
        })
        .collect()
}

/// A driver install with a hook binary answering `version`; its claim spec.
fn spec_with_toolkit(binary: &str, version: &str) -> Spec {
    let host = Host::new();
    host.node("nvidia0");
    host.file("usr/lib/x86_64-linux-gnu/libcuda.so.550.163.01");
    host.hook(&format!("usr/bin/{binary}"), version);
    let files = discover_driver_files(&host.opts.root);
    claim_spec(
        &host.opts,
        UID,
        &[gpu_device(0, Sharing::Exclusive)],
        &files,
    )
    .unwrap()
}

#[test]
fn below_1_17_8_the_spec_leaves_out_enable_cuda_compat_and_update_ldcache() {
    let all = [
        "create-symlinks",
        "enable-cuda-compat",
        "update-ldcache",
        "disable-device-node-modification",
    ];
    let floor = ["create-symlinks"];
    // 1.17.8 and 1.17.9 have the fixes, and no disable-device-node-modification yet.
    let fixed = &all[..3];
    for binary in ["nvidia-cdi-hook", "nvidia-ctk"] {
        for (version, expected) in [
            ("1.17.7", &floor[..]),
            ("1.16.2", &floor[..]),
            ("1.17.8", fixed),
            ("1.17.9", fixed),
            ("1.18.0", &all[..]),
            ("1.19.1", &all[..]),
            ("unknown", &floor[..]),
        ] {
            let spec = spec_with_toolkit(binary, version);
            assert_eq!(hook_names(&spec), expected, "{binary} {version}");
        }
    }
    // The hooks that stay are as they were: the same binary, env and arguments.
    let below = spec_with_toolkit("nvidia-cdi-hook", "1.17.7");
    let fixed = spec_with_toolkit("nvidia-cdi-hook", "1.18.0");
    let args = |s: &Spec| -> Vec<Vec<String>> {
        s.container_edits
            .hooks
            .iter()
            .filter(|h| h.args[1] == "create-symlinks")
            .map(|h| (h.args.clone(), h.env.clone(), h.hook_name.clone()))
            .map(|(a, e, n)| [a, e, vec![n]].concat())
            .collect()
    };
    assert_eq!(args(&below).len(), 1);
    assert_eq!(args(&below), args(&fixed));
}
