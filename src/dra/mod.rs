//! The DRA kubelet plugin: registration with the kubelet, the `DRAPlugin` gRPC service (v1 and
//! v1beta1) and the prepare/unprepare state machine behind it.

pub mod grpc;
pub mod mps;
pub mod nodelock;
pub mod plugin;
pub mod registration;
pub mod wire;
