//! One gRPC server per resource, on `<kubelet root>/device-plugins/nvidia-<name>.sock`: each
//! resource's [`Slot`] holds its server and the device list its `ListAndWatch` streams follow.
//! An own socket that is gone or replaced (a kubelet restart deletes them all) is bound again, its
//! old server and streams stopped. Every server goes through [`socket::incoming`], so the
//! kubelet's `:authority` habits are handled as on the DRA socket.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kubelet_plugin::proto::deviceplugin::v1beta1::device_plugin_server::DevicePluginServer;
use kubelet_plugin::socket;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::deviceplugin::ResourceName;
use crate::deviceplugin::allocate::Context;
use crate::deviceplugin::both::Both;
use crate::deviceplugin::resources::Resource;
use crate::deviceplugin::service::Service;

/// The file identity of a socket: device, inode, mtime.
pub(super) type Identity = (u64, u64, i64, i64);

pub(super) fn identity(path: &Path) -> Option<Identity> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.mtime(), m.mtime_nsec()))
}

/// One resource: its server, and where it stands with the kubelet.
pub(super) struct Slot {
    pub(super) name: ResourceName,
    pub(super) path: PathBuf,
    pub(super) devices: watch::Sender<Arc<Resource>>,
    pub(super) server: Option<(CancellationToken, JoinHandle<()>, Identity)>,
    /// The `kubelet.sock` this resource is registered with.
    pub(super) registered: Option<Identity>,
    /// The `kubelet.sock` of the last failed attempt, when to try again, and the next delay.
    pub(super) failed: Option<(Identity, Instant, Duration)>,
}

impl Slot {
    pub(super) fn new(dir: &Path, r: Resource) -> Slot {
        Slot {
            path: dir.join(r.name.socket_file()),
            name: r.name.clone(),
            devices: watch::channel(Arc::new(r)).0,
            server: None,
            registered: None,
            failed: None,
        }
    }
}

/// (Re)starts the server of every slot whose socket is missing, replaced, or whose server
/// ended; such a slot must register again.
pub(super) fn ensure_servers(
    slots: &mut [Slot],
    ctx: &Arc<Context>,
    both: Option<&Both>,
    shutdown: &CancellationToken,
) -> Result<(), socket::Error> {
    for slot in slots {
        let healthy = match &slot.server {
            Some((_, handle, id)) => !handle.is_finished() && identity(&slot.path) == Some(*id),
            None => false,
        };
        if healthy {
            continue;
        }
        if let Some((token, _, _)) = slot.server.take() {
            tracing::info!(resource = %slot.name, socket = %slot.path.display(),
                "device-plugin socket removed or server ended; serving it again");
            token.cancel();
        }
        let listener = socket::bind(&slot.path)?;
        let Some(id) = identity(&slot.path) else {
            // Removed between bind and stat: try again next tick.
            continue;
        };
        let token = shutdown.child_token();
        let service = Service {
            name: slot.name.clone(),
            devices: slot.devices.subscribe(),
            ctx: ctx.clone(),
            both: both.cloned(),
            shutdown: token.clone(),
        };
        let (path, t) = (slot.path.clone(), token.clone());
        let handle = tokio::spawn(async move {
            let r = tonic::transport::Server::builder()
                .add_service(DevicePluginServer::new(service))
                .serve_with_incoming_shutdown(socket::incoming(listener), t.cancelled())
                .await;
            if let Err(e) = r {
                tracing::warn!(socket = %path.display(), error = %crate::report::chain(&e), "device-plugin server failed");
            }
        });
        tracing::info!(resource = %slot.name, socket = %slot.path.display(), "device-plugin server listening");
        slot.server = Some((token, handle, id));
        slot.registered = None;
    }
    Ok(())
}
/// Sends each resource's new device list when it changed. A resource that disappeared is sent
/// empty (the kubelet then lowers its capacity to 0) and stays registered, so it returns without
/// a new registration; a new one (a MIG reconfiguration) gets a slot, whose server the next tick
/// starts and registers.
pub(super) fn update(slots: &mut Vec<Slot>, dir: &Path, res: Vec<Resource>) {
    for slot in slots.iter() {
        let new = res
            .iter()
            .find(|r| r.name == slot.name)
            .cloned()
            .unwrap_or_else(|| Resource {
                name: slot.name.clone(),
                devices: Vec::new(),
                fail_requests_greater_than_one: false,
            });
        slot.devices.send_if_modified(|cur| {
            if **cur == new {
                return false;
            }
            tracing::info!(resource = %slot.name, devices = new.devices.len(),
                unhealthy = new.devices.iter().filter(|d| !d.health.is_healthy()).count(),
                "device list changed");
            *cur = Arc::new(new);
            true
        });
    }
    for r in res {
        if !slots.iter().any(|s| s.name == r.name) {
            tracing::info!(resource = %r.name, devices = r.devices.len(), "new device-plugin resource");
            slots.push(Slot::new(dir, r));
        }
    }
}
pub(super) async fn stop_server(slot: &mut Slot) {
    if let Some((token, handle, id)) = slot.server.take() {
        token.cancel();
        let _ = handle.await;
        // Only our own socket: a newer instance may have bound the path since.
        if identity(&slot.path) == Some(id) {
            let _ = std::fs::remove_file(&slot.path);
        }
    }
}
