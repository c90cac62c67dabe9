//! Generated gRPC code for the kubelet's plugin APIs: DRA (`v1`, `v1beta1`), DRA health, plugin
//! registration, device plugin `v1beta1` and PodResources `v1`. Clients and servers both: a
//! driver serves them, and its tests play the kubelet with them.
#![allow(clippy::all, missing_docs)]

pub mod dra {
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    }
}

pub mod health {
    pub mod v1alpha1 {
        tonic::include_proto!("v1alpha1");
    }
    /// Its proto package is `v1beta1`, as the device-plugin API's is: prost generates one
    /// module for both, so the health service is re-exported from there. Its messages are
    /// v1alpha1's (build.rs maps them), as the protos are identical field for field.
    pub mod v1beta1 {
        pub use super::v1alpha1::{
            DeviceHealth, DeviceIdentifier, HealthStatus, NodeWatchResourcesRequest,
            NodeWatchResourcesResponse,
        };
        pub use crate::proto::deviceplugin::v1beta1::{
            dra_resource_health_client, dra_resource_health_server,
        };
    }
    /// Package `v1`, which it shares with PodResources; messages are v1alpha1's, as for v1beta1.
    pub mod v1 {
        tonic::include_proto!("v1");
        pub use super::v1alpha1::{
            DeviceHealth, DeviceIdentifier, HealthStatus, NodeWatchResourcesRequest,
            NodeWatchResourcesResponse,
        };
    }
}

pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

pub mod deviceplugin {
    pub mod v1beta1 {
        tonic::include_proto!("v1beta1");
    }
}

/// The kubelet's PodResources API. Its proto package is `v1`, the same as DRA health v1's, so
/// prost generates both into one file: this re-exports the PodResources part of it.
pub mod podresources {
    pub mod v1 {
        pub use super::super::health::v1::pod_resources_lister_client;
        pub use super::super::health::v1::pod_resources_lister_server;
        pub use super::super::health::v1::{
            ContainerDevices, ContainerResources, ListPodResourcesRequest,
            ListPodResourcesResponse, PodResources,
        };
    }
}
