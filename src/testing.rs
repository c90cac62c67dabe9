//! Helpers only tests and benches use (feature `testing`, which this package's dev-dependency on
//! itself turns on; never in a release build): an inventory owner started without the daemon,
//! and a health state that never changes for an owner no monitor feeds.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::inventory::DeviceBackend;
use crate::inventory::health::HealthState;
use crate::inventory::owner::{DEADLINE, InventoryHandle, Owner};

/// An owner over `backend` after its first read, following `health` and reading every `rescan`
/// (and when asked) until `shutdown`: its handle.
pub async fn start_owner(
    backend: Arc<dyn DeviceBackend>,
    rescan: Duration,
    health: watch::Receiver<HealthState>,
    shutdown: CancellationToken,
) -> std::io::Result<InventoryHandle> {
    let (mut owner, handle) = Owner::new(backend, rescan, DEADLINE)?;
    let _ = owner.read().await;
    tokio::spawn(owner.run(health, shutdown));
    Ok(handle)
}

/// A health state that never changes, for an owner no health monitor feeds ([`Owner::run`]).
pub fn no_health() -> watch::Receiver<HealthState> {
    watch::channel(HealthState::default()).1
}
