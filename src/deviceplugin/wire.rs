//! Conversions between the `v1beta1` device-plugin protos and the domain types. Protos are
//! destructured exhaustively, so a field added to the API breaks the build here instead of being
//! dropped silently.

use crate::inventory::Health;
use kubelet_plugin::proto::deviceplugin::v1beta1 as pb;

use super::ResourceName;
use super::allocate::{ContainerAllocation, DeviceSpec, MountSpec};
use super::preferred;
use super::resources::Resource;

/// The API version nvdra registers with.
pub const VERSION: &str = "v1beta1";
/// `Device.health` values.
pub const HEALTHY: &str = "Healthy";
pub const UNHEALTHY: &str = "Unhealthy";

/// What every resource server offers: preferred allocation, no PreStartContainer.
pub fn plugin_options() -> pb::DevicePluginOptions {
    pb::DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

pub fn register_request(resource: &ResourceName, endpoint: &str) -> pb::RegisterRequest {
    pb::RegisterRequest {
        version: VERSION.into(),
        endpoint: endpoint.into(),
        resource_name: resource.to_string(),
        options: Some(plugin_options()),
    }
}

/// The full device list of `resource`.
pub fn list_response(resource: &Resource) -> pb::ListAndWatchResponse {
    pb::ListAndWatchResponse {
        devices: resource
            .devices
            .iter()
            .map(|d| pb::Device {
                id: d.id.clone(),
                health: match d.health {
                    Health::Healthy => HEALTHY.into(),
                    Health::Unhealthy { .. } | Health::Tainted { .. } => UNHEALTHY.into(),
                },
                topology: d.numa_node.map(|n| pb::TopologyInfo {
                    nodes: vec![pb::NumaNode { id: i64::from(n) }],
                }),
            })
            .collect(),
    }
}

/// The device IDs of each container, in request order.
pub fn allocate_requests(req: pb::AllocateRequest) -> Vec<Vec<String>> {
    let pb::AllocateRequest { container_requests } = req;
    container_requests
        .into_iter()
        .map(|c| {
            let pb::ContainerAllocateRequest { devices_ids } = c;
            devices_ids
        })
        .collect()
}

pub fn container_response(a: ContainerAllocation) -> pb::ContainerAllocateResponse {
    let ContainerAllocation {
        envs,
        mounts,
        devices,
        annotations,
        cdi_devices,
    } = a;
    pb::ContainerAllocateResponse {
        envs: envs.into_iter().collect(),
        mounts: mounts
            .into_iter()
            .map(|m| {
                let MountSpec {
                    container_path,
                    host_path,
                    read_only,
                } = m;
                pb::Mount {
                    container_path,
                    host_path,
                    read_only,
                }
            })
            .collect(),
        devices: devices
            .into_iter()
            .map(|d| {
                let DeviceSpec {
                    container_path,
                    host_path,
                    permissions,
                } = d;
                pb::DeviceSpec {
                    container_path,
                    host_path,
                    permissions,
                }
            })
            .collect(),
        annotations: annotations.into_iter().collect(),
        cdi_devices: cdi_devices
            .into_iter()
            .map(|name| pb::CdiDevice { name })
            .collect(),
    }
}

/// Each container's request; a negative size counts as 0.
pub fn preferred_requests(req: pb::PreferredAllocationRequest) -> Vec<preferred::Request> {
    let pb::PreferredAllocationRequest { container_requests } = req;
    container_requests
        .into_iter()
        .map(|c| {
            let pb::ContainerPreferredAllocationRequest {
                available_device_i_ds,
                must_include_device_i_ds,
                allocation_size,
            } = c;
            preferred::Request {
                available: available_device_i_ds,
                must_include: must_include_device_i_ds,
                size: usize::try_from(allocation_size).unwrap_or(0),
            }
        })
        .collect()
}

pub fn preferred_response(answers: Vec<Vec<String>>) -> pb::PreferredAllocationResponse {
    pb::PreferredAllocationResponse {
        container_responses: answers
            .into_iter()
            .map(|device_i_ds| pb::ContainerPreferredAllocationResponse { device_i_ds })
            .collect(),
    }
}
