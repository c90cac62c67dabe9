//! Counter set names. (A device's name is [`crate::ids::DeviceName`]'s, and
//! [`crate::ids::find_device`] reads one back.)

/// The name of a GPU's (first) counter set in partitionable mode: `gpu-<minor>-counter-set`.
pub fn counter_set_name(minor: u32) -> String {
    format!("gpu-{minor}-counter-set")
}

pub(super) fn extra_counter_set_name(minor: u32, n: usize) -> String {
    format!("gpu-{minor}-counter-set-{n}")
}
