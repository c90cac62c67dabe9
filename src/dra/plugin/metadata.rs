//! Device metadata (KEP-5304) of nvdra's claims: the start-up repair of the files of claims the
//! checkpoint no longer holds. What each prepared device's file holds is
//! [`crate::dra::slices::device_metadata`], read from the node at a prepare's answer
//! (`prepare.rs`); the kubelet-plugin library writes and removes the files.

use std::collections::BTreeSet;

use kubelet_plugin::metadata::Files;

use super::Plugin;
use crate::report::chain;

impl Plugin {
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
