//! Device metadata (KEP-5304) of nvdra's claims: the inventory each prepared device's file is
//! read from ([`crate::dra::slices::device_metadata`] says what it holds; the kubelet-plugin
//! library writes and removes the files), and the start-up repair of the files of claims the
//! checkpoint no longer holds.

use std::collections::BTreeSet;
use std::sync::Arc;

use kubelet_plugin::metadata::Files;

use super::Plugin;
use crate::inventory::Inventory;
use crate::report::chain;

impl Plugin {
    /// The inventory prepared devices' metadata is read from: the owner's publication; `None`
    /// (logged) when there is none, and the files then name the devices only.
    pub(crate) async fn metadata_inventory(&self) -> Option<Arc<Inventory>> {
        match self.snapshot().await {
            Ok(inv) => Some(inv),
            Err(e) => {
                tracing::warn!(error = %chain(&e), "cannot read the inventory; the device metadata files name the devices only");
                None
            }
        }
    }

    /// Removes the device metadata files of every claim the checkpoint does not hold (prepared
    /// ones are kept), under the node lock, so that a rolling update's other instance cannot
    /// prepare a claim between the read of the checkpoint and the removal. Call once at start-up,
    /// after [`Plugin::recover`]. Failures are logged: a stale file is a leak, not a fault.
    /// Returns the claims (or directories) whose files went.
    pub async fn retain_metadata(&self, files: &Files) -> Vec<String> {
        let _g = match self.enter().await {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!(error = %chain(&e), "cannot take the node lock; stale device metadata files stay until the next start");
                return Vec::new();
            }
        };
        let known: BTreeSet<String> = self
            .inner
            .ledger
            .read(|c| c.claims.keys().map(|u| u.as_str().to_string()).collect());
        let files = files.clone();
        let removed =
            tokio::task::spawn_blocking(move || files.retain(|uid| known.contains(uid))).await;
        match removed {
            Ok(Ok(removed)) => {
                if !removed.is_empty() {
                    tracing::info!(claims = ?removed, "removed the device metadata files of claims no longer prepared");
                }
                removed
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %chain(&e), "cannot remove stale device metadata files");
                Vec::new()
            }
            Err(e) => {
                tracing::warn!(error = %e, "the removal of stale device metadata files failed");
                Vec::new()
            }
        }
    }
}
