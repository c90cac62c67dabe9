//! Compiles the kubelet protos with protox (pure Rust), so building nvdra needs no `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/dra/v1/api.proto",
        "proto/dra/v1beta1/api.proto",
        "proto/dra-health/v1alpha1/api.proto",
        "proto/dra-health/v1beta1/api.proto",
        "proto/dra-health/v1/api.proto",
        "proto/pluginregistration/v1/api.proto",
        "proto/deviceplugin/v1beta1/api.proto",
        "proto/podresources/v1/api.proto",
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["."])?;
    let mut config = tonic_prost_build::configure()
        .build_client(true)
        .build_server(true);
    // The health API's v1beta1 and v1 messages are v1alpha1's, field for field: their services
    // are generated over the v1alpha1 types, so one stream serves all three with no conversion.
    for version in ["v1beta1", "v1"] {
        for message in [
            "NodeWatchResourcesRequest",
            "NodeWatchResourcesResponse",
            "DeviceHealth",
            "DeviceIdentifier",
            "HealthStatus",
        ] {
            config = config.extern_path(
                format!(".{version}.{message}"),
                format!("crate::proto::health::v1alpha1::{message}"),
            );
        }
    }
    config.compile_fds(fds)?;
    pack_relative_relocations();
    order_hot_functions();
    Ok(())
}

/// Release binaries on glibc pack their relative relocations (`DT_RELR`, glibc ≥ 2.36, GNU ld ≥
/// 2.38). A position-independent nvdra carries ~30,000 of them (every pointer in its read-only
/// data); as plain `RELA` entries they are 0.7 MiB that the loader reads at every start and
/// that stay resident (benches/rss.rs). Packed, they are a few KiB. Debug builds (the tests)
/// keep the default so that any toolchain builds them.
fn pack_relative_relocations() {
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    println!("cargo:rerun-if-env-changed=NVDRA_NO_RELR");
    if var("PROFILE") == "release"
        && var("CARGO_CFG_TARGET_OS") == "linux"
        && var("CARGO_CFG_TARGET_ENV") == "gnu"
        && std::env::var_os("NVDRA_NO_RELR").is_none()
    {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}

/// Release binaries linked by rustc's own LLD (x86_64-unknown-linux-gnu's default since Rust
/// 1.90) put the functions a running daemon executes first in `.text`, in the order of
/// `link/hot-functions.txt` (made by `link/order.py`). The daemon's resident set is mostly code
/// pages; the ~2.4 MB it runs, scattered over 16 MB, kept ~9 MiB of them resident
/// (benches/rss.rs). Names the binary no longer has are skipped silently, so a stale list only
/// costs memory. `NVDRA_NO_ORDER=1`, another target or a configured linker leave the layout alone.
fn order_hot_functions() {
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let list = std::path::Path::new(&var("CARGO_MANIFEST_DIR")).join("link/hot-functions.txt");
    println!("cargo:rerun-if-changed=link/hot-functions.txt");
    println!("cargo:rerun-if-env-changed=NVDRA_NO_ORDER");
    let flags = var("CARGO_ENCODED_RUSTFLAGS");
    if var("PROFILE") == "release"
        && var("TARGET") == "x86_64-unknown-linux-gnu"
        && std::env::var_os("RUSTC_LINKER").is_none()
        && !flags.contains("linker-features")
        && !flags.contains("link-self-contained")
        && std::env::var_os("NVDRA_NO_ORDER").is_none()
        && list.is_file()
    {
        println!(
            "cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={}",
            list.display()
        );
        println!("cargo:rustc-link-arg-bins=-Wl,--no-warn-symbol-ordering");
    }
}
