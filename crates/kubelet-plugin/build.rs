//! Compiles the kubelet's plugin protos with protox (pure Rust), so building needs no `protoc`.

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
    Ok(())
}
