//! What wakes the serving loop: the loop waits in one place, [`Wakers::next`], for a named
//! reason ([`Wake`]), and hands each to its own method; a mode that waits on something new adds a
//! `Wake` and a handler, not an arm in a long `select!`.

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::deviceplugin::Mapped;
use crate::inventory;

use super::DevicePlugin;

/// What wakes the serving loop; [`Wakers::next`] looks in this order.
pub(super) enum Wake {
    Shutdown,
    /// Time to check the sockets and registrations ([`Settings::watch`](super::Settings::watch)).
    Tick,
    /// `--mode both`: the ledger changed.
    Ledger,
    /// `--mode auto`: the DeviceClasses' mapping changed.
    Classes,
    /// The PodResources poll ended, with why.
    PodsEnded(String),
    /// The inventory owner published again (a read or a health transition): time to look at
    /// its node.
    Reread,
}

/// Everything the serving loop waits on; each mode adds its own.
pub(super) struct Wakers {
    tick: tokio::time::Interval,
    /// `--mode both`: the ledger's changes.
    changes: Option<watch::Receiver<u64>>,
    /// `--mode auto`: the resource names DeviceClasses map to DRA.
    pub(super) mapped: Option<watch::Receiver<Mapped>>,
    /// The PodResources poll, when one runs.
    pods: Option<JoinHandle<()>>,
    /// The inventory owner's publications; `None` once the owner is gone.
    published: inventory::owner::Watch,
}

impl Wakers {
    pub(super) fn new(
        plugin: &DevicePlugin,
        changes: Option<watch::Receiver<u64>>,
        pods: Option<JoinHandle<()>>,
    ) -> Self {
        let mut tick = tokio::time::interval(plugin.settings.watch);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut published = plugin.node.clone();
        // The lists the loop starts with are from the latest publication already.
        published.mark_unchanged();
        Wakers {
            tick,
            changes,
            mapped: plugin.mapped.clone(),
            pods,
            published,
        }
    }

    /// Waits for the next reason to act; shutdown first, then in the order of [`Wake`].
    pub(super) async fn next(&mut self, shutdown: &CancellationToken) -> Wake {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => Wake::Shutdown,
            _ = self.tick.tick() => Wake::Tick,
            Ok(()) = async {
                match &mut self.changes {
                    Some(c) => c.changed().await,
                    None => std::future::pending().await,
                }
            } => Wake::Ledger,
            Ok(()) = async {
                match &mut self.mapped {
                    Some(m) => m.changed().await,
                    None => std::future::pending().await,
                }
            } => Wake::Classes,
            Some(done) = async {
                match &mut self.pods {
                    Some(p) => Some(p.await),
                    None => std::future::pending().await,
                }
            } => Wake::PodsEnded(match done {
                Ok(()) => "ended".to_string(),
                Err(e) => e.to_string(),
            }),
            () = inventory::owner::changed(&mut self.published) => Wake::Reread,
        }
    }
}
