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
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
