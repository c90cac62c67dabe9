//! The DRA side of nvdra: desired ResourceSlices from the inventory, and publishing them.

pub mod publisher;
