//! `nvdra inventory -o paths`: which path serves each resource name, per mode; in `auto` read
//! from the directory API's DeviceClasses (`DIR/deviceclasses/<name>.yaml`).

use std::process::Command;

fn paths(args: &[&str], api: &std::path::Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_nvdra"))
        .args(["inventory", "-o", "paths", "--profile", "a100-mig-mixed"])
        .args(["--node-name", "n1"])
        .arg("--api-dir")
        .arg(api)
        .args(args)
        .env_remove("NVDRA_MODE")
        .env_remove("NVDRA_CONFIG")
        .env("NVDRA_LOG", "error")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn line<'a>(text: &'a str, resource: &str) -> &'a str {
    text.lines()
        .find(|l| l.split_whitespace().next() == Some(resource))
        .unwrap_or_else(|| panic!("no {resource} in:\n{text}"))
}

#[test]
fn auto_names_the_device_class_that_leaves_a_name_to_dra() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("dp.yaml");
    std::fs::write(&cfg, "version: v1\nflags:\n  migStrategy: mixed\n").unwrap();
    let cfg = cfg.to_str().unwrap();

    let plain = paths(&["--device-plugin-config", cfg], dir.path());
    assert!(
        line(&plain, "nvidia.com/gpu").ends_with("device plugin"),
        "{plain}"
    );
    assert!(line(&plain, "DRA").contains("gpu.nvidia.com"), "{plain}");

    std::fs::create_dir_all(dir.path().join("deviceclasses")).unwrap();
    std::fs::write(
        dir.path().join("deviceclasses/gpu-legacy.yaml"),
        "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata:\n  name: gpu-legacy\nspec:\n  extendedResourceName: nvidia.com/gpu\n",
    )
    .unwrap();
    let mapped = paths(&["--device-plugin-config", cfg], dir.path());
    assert!(
        line(&mapped, "nvidia.com/gpu").contains("DRA (DeviceClass gpu-legacy"),
        "{mapped}"
    );
    assert!(
        line(&mapped, "nvidia.com/mig-1g.10gb").ends_with("device plugin"),
        "{mapped}"
    );

    // An explicit mode does not ask the API.
    let dp = paths(
        &["--mode", "device-plugin", "--device-plugin-config", cfg],
        dir.path(),
    );
    assert!(
        line(&dp, "nvidia.com/gpu").ends_with("device plugin"),
        "{dp}"
    );
    assert!(
        line(&dp, "DRA").starts_with("DRA") && line(&dp, "DRA").contains("none"),
        "{dp}"
    );
}
