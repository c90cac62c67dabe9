//! What the plugin publishes and what it injects: the node's devices (NVIDIA's `channel-0` and
//! `daemon-0`, with the `type` and `id` attributes its DeviceClasses select on), the readiness
//! taint and binding conditions on the channel, and the character devices read from procfs (the
//! IMEX channels' major from `/proc/devices`, the `fabric-imex-mgmt` capability's node).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, bail};
use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, DeviceTaint};

use crate::cdi::DeviceNode;
use crate::computedomain::api::{ATTR_ID, ATTR_TYPE, CHANNEL_DIR, TYPE_CHANNEL, TYPE_DAEMON};

/// The node's channel device.
pub const CHANNEL_0: &str = "channel-0";
/// The node's daemon device.
pub const DAEMON_0: &str = "daemon-0";
/// How many IMEX channels a node has (NVIDIA's `getImexChannelCount`: the driver's default
/// `NVreg_ImexChannelCount`); `allocationMode: All` injects them all.
pub const CHANNEL_COUNT: u32 = 2048;

/// The binding condition of the node's channel (KEP-5007): the scheduler binds a pod whose claim
/// got `channel-0` only once the plugin set this condition `True` on the claim's device, which it
/// does when the node's IMEX daemon for the claim's domain is Ready.
pub const BINDING_CONDITION: &str = "ComputeDomainReady";
/// The binding failure condition: set `True` when the node cannot serve the claim's domain (it
/// serves another one), so the scheduler gives the device back and places the pod elsewhere.
pub const BINDING_FAILURE_CONDITION: &str = "ComputeDomainFailed";
/// The taint on the node's channel while the node's IMEX daemon is not ready.
pub const TAINT_NOT_READY: &str = "compute-domain.nvidia.com/daemon-not-ready";

/// The `nvidia-caps` character-device major's name in `/proc/devices` (capability nodes).
pub const CAPS_MAJOR_NAME: &str = "nvidia-caps";
/// The capability file of the IMEX daemon's management node, under the capabilities root.
pub const FABRIC_IMEX_MGMT: &str = "fabric-imex-mgmt";

/// A device kind the plugin prepares, and its number (`channel-<N>`, `daemon-<N>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Channel(u32),
    Daemon(u32),
}

impl Kind {
    /// Reads a device name: `channel-<N>` (N below [`CHANNEL_COUNT`]) or `daemon-<N>`.
    pub fn parse(device: &str) -> Option<Kind> {
        let number = |s: &str| -> Option<u32> {
            (!s.is_empty()
                && s.bytes().all(|b| b.is_ascii_digit())
                && (s == "0" || !s.starts_with('0')))
            .then(|| s.parse().ok())
            .flatten()
        };
        if let Some(n) = device.strip_prefix("channel-").and_then(number) {
            return (n < CHANNEL_COUNT).then_some(Kind::Channel(n));
        }
        device
            .strip_prefix("daemon-")
            .and_then(number)
            .map(Kind::Daemon)
    }
}

fn attributes(kind: &str, id: i64) -> BTreeMap<String, DeviceAttribute> {
    BTreeMap::from([
        (
            ATTR_TYPE.to_string(),
            DeviceAttribute {
                string: Some(kind.into()),
                ..DeviceAttribute::default()
            },
        ),
        (
            ATTR_ID.to_string(),
            DeviceAttribute {
                int: Some(id),
                ..DeviceAttribute::default()
            },
        ),
    ])
}

/// The node's devices as NVIDIA publishes them: `channel-0` (the other channels are handed out
/// from the controller's pools, never here) and `daemon-0`. `binding_conditions`: the channel
/// carries [`BINDING_CONDITION`] and [`BINDING_FAILURE_CONDITION`]. `not_ready`: the channel is
/// tainted [`TAINT_NOT_READY`] `NoSchedule`, its value the domain whose daemon is not ready. The
/// daemon device is never tainted: the daemon must be able to land where it is not ready.
pub fn node_devices(binding_conditions: bool, not_ready: Option<&str>) -> Vec<Device> {
    let mut channel = Device {
        name: CHANNEL_0.into(),
        attributes: Some(attributes(TYPE_CHANNEL, 0)),
        ..Device::default()
    };
    if binding_conditions {
        channel.binding_conditions = Some(vec![BINDING_CONDITION.into()]);
        channel.binding_failure_conditions = Some(vec![BINDING_FAILURE_CONDITION.into()]);
    }
    if let Some(domain) = not_ready {
        channel.taints = Some(vec![DeviceTaint {
            key: TAINT_NOT_READY.into(),
            // A domain UID is a valid label value (36 characters of [0-9a-f-]); anything else
            // goes without a value.
            value: is_label_value(domain).then(|| domain.to_string()),
            effect: "NoSchedule".into(),
            time_added: None,
        }]);
    }
    let daemon = Device {
        name: DAEMON_0.into(),
        attributes: Some(attributes(TYPE_DAEMON, 0)),
        ..Device::default()
    };
    vec![channel, daemon]
}

fn is_label_value(v: &str) -> bool {
    v.len() <= 63
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && v.bytes().next().is_none_or(|b| b.is_ascii_alphanumeric())
        && v.bytes().last().is_none_or(|b| b.is_ascii_alphanumeric())
}

/// The major of the character device `name` in a `/proc/devices` text: the first
/// `<major> <name>` line of its "Character devices:" section (as NVIDIA's `GetDeviceMajor`).
pub fn parse_major(text: &str, name: &str) -> Option<u32> {
    let mut in_chars = false;
    for line in text.lines() {
        let line = line.trim();
        if line.ends_with(':') {
            in_chars = line == "Character devices:";
            continue;
        }
        if !in_chars {
            continue;
        }
        if let Some((major, n)) = line.split_once(char::is_whitespace)
            && n.trim() == name
        {
            return major.parse().ok();
        }
    }
    None
}

/// [`parse_major`] of the file at `path`; an error names the file and the device.
pub fn read_major(path: &Path, name: &str) -> anyhow::Result<u32> {
    let text = std::fs::read_to_string(path).with_context(|| {
        format!(
            "cannot read {} (pass the right file with --proc-devices)",
            path.display()
        )
    })?;
    match parse_major(&text, name) {
        Some(m) => Ok(m),
        None => bail!(
            "{} has no character device {name:?}: is the NVIDIA driver loaded (with IMEX \
             channels, NVreg_ImexChannelCount > 0)?",
            path.display()
        ),
    }
}

/// The device node of IMEX channel `n` (`/dev/nvidia-caps-imex-channels/channel<n>`) with
/// `major`: a character device the runtime creates in the container, mode 0666, as NVIDIA's.
pub fn channel_node(major: u32, n: u32) -> DeviceNode {
    DeviceNode {
        path: format!("{CHANNEL_DIR}/channel{n}"),
        host_path: None,
        node_type: Some("c".into()),
        major: Some(i64::from(major)),
        minor: Some(i64::from(n)),
        file_mode: Some(0o666),
        permissions: None,
    }
}

/// The device node of a capability file (`DeviceFileMinor: N`, `DeviceFileMode: M` lines, as
/// under `/proc/driver/nvidia/capabilities`): `/dev/nvidia-caps/nvidia-cap<N>` with the
/// `nvidia-caps` major.
pub fn capability_node(cap_text: &str, caps_major: u32) -> Option<DeviceNode> {
    let mut minor = None;
    let mut mode = None;
    for line in cap_text.lines() {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        match k.trim() {
            "DeviceFileMinor" => minor = v.trim().parse::<u32>().ok(),
            "DeviceFileMode" => mode = v.trim().parse::<u32>().ok(),
            _ => {}
        }
    }
    let minor = minor?;
    Some(DeviceNode {
        path: format!("/dev/nvidia-caps/nvidia-cap{minor}"),
        host_path: None,
        node_type: Some("c".into()),
        major: Some(i64::from(caps_major)),
        minor: Some(i64::from(minor)),
        // NVIDIA's parser reads the mode as a decimal number, which the driver writes
        // (`DeviceFileMode: 256` = 0400).
        file_mode: mode,
        permissions: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::computedomain::api::CHANNEL_MAJOR_NAME;

    const PROC_DEVICES: &str = "Character devices:\n  1 mem\n195 nvidia\n234 nvidia-caps-imex-channels\n\
        235 nvidia-caps\n236 nvidia-caps-imex-channels-x\n\nBlock devices:\n  7 nvidia-caps\n";

    #[test]
    fn the_major_is_the_exact_name_in_the_character_section() {
        assert_eq!(parse_major(PROC_DEVICES, CHANNEL_MAJOR_NAME), Some(234));
        assert_eq!(parse_major(PROC_DEVICES, CAPS_MAJOR_NAME), Some(235));
        assert_eq!(parse_major(PROC_DEVICES, "nvidia-uvm"), None);
        // Only the block section has it.
        assert_eq!(
            parse_major("Character devices:\n1 mem\n\nBlock devices:\n7 x\n", "x"),
            None
        );
    }

    #[test]
    fn device_names_read_as_nvidia_writes_them() {
        assert_eq!(Kind::parse("channel-0"), Some(Kind::Channel(0)));
        assert_eq!(Kind::parse("channel-2047"), Some(Kind::Channel(2047)));
        assert_eq!(Kind::parse("channel-2048"), None);
        assert_eq!(Kind::parse("channel-01"), None);
        assert_eq!(Kind::parse("channel-"), None);
        assert_eq!(Kind::parse("daemon-0"), Some(Kind::Daemon(0)));
        assert_eq!(Kind::parse("gpu-0"), None);
    }

    #[test]
    fn the_node_publishes_nvidias_two_devices_and_taints_only_the_channel() {
        let devices = node_devices(true, Some("3f0e6b4a-0000-4000-8000-000000000001"));
        assert_eq!(devices.len(), 2);
        let (channel, daemon) = (&devices[0], &devices[1]);
        assert_eq!(channel.name, "channel-0");
        let attrs = channel.attributes.as_ref().unwrap();
        assert_eq!(attrs["type"].string.as_deref(), Some("channel"));
        assert_eq!(attrs["id"].int, Some(0));
        assert_eq!(channel.taints.as_ref().unwrap()[0].effect, "NoSchedule");
        assert_eq!(
            channel.binding_conditions.as_deref(),
            Some(&[BINDING_CONDITION.to_string()][..])
        );
        assert_eq!(daemon.name, "daemon-0");
        assert_eq!(
            daemon.attributes.as_ref().unwrap()["type"]
                .string
                .as_deref(),
            Some("daemon")
        );
        assert!(daemon.taints.is_none() && daemon.binding_conditions.is_none());
        let plain = node_devices(false, None);
        assert!(plain[0].taints.is_none() && plain[0].binding_conditions.is_none());
        for d in devices.iter().chain(&plain) {
            let slice = k8s_openapi::api::resource::v1::ResourceSliceSpec {
                devices: Some(vec![d.clone()]),
                driver: "compute-domain.nvidia.com".into(),
                node_name: Some("node-a".into()),
                pool: k8s_openapi::api::resource::v1::ResourcePool {
                    name: "node-a".into(),
                    generation: 0,
                    resource_slice_count: 1,
                },
                ..Default::default()
            };
            let v = kubelet_plugin::validate::validate(&slice);
            assert!(v.is_empty(), "{v:?}");
        }
    }

    #[test]
    fn a_channel_is_a_char_device_with_the_major_and_its_number() {
        let n = channel_node(234, 7);
        assert_eq!(n.path, "/dev/nvidia-caps-imex-channels/channel7");
        assert_eq!(
            (n.node_type.as_deref(), n.major, n.minor),
            (Some("c"), Some(234), Some(7))
        );
    }

    #[test]
    fn the_capability_file_gives_the_mgmt_node() {
        let text = "DeviceFileMinor: 2\nDeviceFileMode: 256\nDeviceFileModify: 1\n";
        let n = capability_node(text, 235).unwrap();
        assert_eq!(n.path, "/dev/nvidia-caps/nvidia-cap2");
        assert_eq!(
            (n.major, n.minor, n.file_mode),
            (Some(235), Some(2), Some(256))
        );
        assert!(capability_node("nothing: here\n", 235).is_none());
    }
}
