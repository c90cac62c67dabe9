//! Sysfs: PCI placement (PCIe root and NUMA node) of a GPU.

use std::path::{Path, PathBuf};

use crate::inventory::PciBusId;

/// What [`map`] needs from sysfs, per PCI device.
pub trait Sysfs {
    /// The target of the `bus/pci/devices/<bus id>` symlink, e.g.
    /// `../../../devices/pci0000:00/0000:00:01.0/0000:07:00.0`.
    fn pci_device_link(&self, bus: &PciBusId) -> Option<PathBuf>;
    /// The contents of `bus/pci/devices/<bus id>/numa_node` (`-1` when the platform has none).
    fn pci_numa_node(&self, bus: &PciBusId) -> Option<String>;
}

/// Sysfs as mounted on this machine.
#[derive(Clone, Debug)]
pub struct HostSysfs {
    pub(super) root: PathBuf,
}

impl HostSysfs {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    fn device(&self, bus: &PciBusId) -> PathBuf {
        self.root.join("bus/pci/devices").join(bus.as_str())
    }
}

impl Sysfs for HostSysfs {
    fn pci_device_link(&self, bus: &PciBusId) -> Option<PathBuf> {
        std::fs::read_link(self.device(bus)).ok()
    }

    fn pci_numa_node(&self, bus: &PciBusId) -> Option<String> {
        std::fs::read_to_string(self.device(bus).join("numa_node")).ok()
    }
}

/// The `pci<domain>:<bus>` component of a PCI device's sysfs path: its PCIe root complex.
pub fn pcie_root_of(device_path: &Path) -> Option<String> {
    device_path.components().find_map(|c| {
        let s = c.as_os_str().to_str()?;
        let (domain, bus) = s.strip_prefix("pci")?.split_once(':')?;
        let hex = |t: &str, n: std::ops::RangeInclusive<usize>| {
            n.contains(&t.len()) && t.chars().all(|c| c.is_ascii_hexdigit())
        };
        (hex(domain, 4..=8) && hex(bus, 2..=2)).then(|| s.to_string())
    })
}

/// The NUMA node sysfs reports, `None` for `-1` (no NUMA) or anything unreadable.
pub(super) fn parse_numa(text: &str) -> Option<u32> {
    text.trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}
