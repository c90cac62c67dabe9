//! Registration on the kubelet's `kubelet.sock`: every resource whose server runs is registered
//! with the `kubelet.sock` that exists now, so a kubelet restart (a new `kubelet.sock`) is
//! answered on the next tick. A refused or failed registration is logged and retried with
//! exponential backoff (1 s up to 30 s), at once when `kubelet.sock` changes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kubelet_plugin::proto::deviceplugin::v1beta1 as pb;
use kubelet_plugin::proto::deviceplugin::v1beta1::registration_client::RegistrationClient;
use kubelet_plugin::socket;
use tokio::time::Instant;
use tonic::Status;

use crate::deviceplugin::wire;

use super::sockets::{Slot, identity};

/// The kubelet's registration socket, in the device-plugin directory.
pub(super) const KUBELET_SOCKET: &str = "kubelet.sock";
/// How long one registration may take.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(5);
const BACKOFF_START: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
enum RegisterError {
    #[error("cannot connect to {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("no answer from {path} within {REGISTER_TIMEOUT:?}")]
    Timeout { path: PathBuf },
    #[error("the kubelet refused the registration")]
    Refused(#[source] Status),
}

/// Registers every slot not yet registered with the current `kubelet.sock`.
pub(super) async fn register_all(slots: &mut [Slot], kubelet_sock: &Path) {
    let Some(kubelet) = identity(kubelet_sock) else {
        for slot in slots.iter_mut() {
            slot.registered = None;
        }
        return;
    };
    let now = Instant::now();
    for slot in slots.iter_mut() {
        if slot.registered == Some(kubelet) || slot.server.is_none() {
            continue;
        }
        if let Some((at, when, _)) = slot.failed
            && at == kubelet
            && now < when
        {
            continue;
        }
        let endpoint = slot.name.socket_file();
        match register(kubelet_sock, wire::register_request(&slot.name, &endpoint)).await {
            Ok(()) => {
                tracing::info!(resource = %slot.name, endpoint, "registered with the kubelet");
                slot.registered = Some(kubelet);
                slot.failed = None;
            }
            Err(e) => {
                let delay = match slot.failed {
                    Some((_, _, d)) => d,
                    None => BACKOFF_START,
                };
                tracing::warn!(resource = %slot.name, error = %crate::report::chain(&e),
                    retry_in = ?delay, "device-plugin registration failed");
                slot.failed = Some((
                    kubelet,
                    Instant::now() + delay,
                    (delay * 2).min(BACKOFF_MAX),
                ));
            }
        }
    }
}

async fn register(kubelet_sock: &Path, req: pb::RegisterRequest) -> Result<(), RegisterError> {
    let call = async {
        let channel =
            socket::connect(kubelet_sock)
                .await
                .map_err(|source| RegisterError::Connect {
                    path: kubelet_sock.to_path_buf(),
                    source,
                })?;
        RegistrationClient::new(channel)
            .register(req)
            .await
            .map_err(RegisterError::Refused)?;
        Ok(())
    };
    tokio::time::timeout(REGISTER_TIMEOUT, call)
        .await
        .map_err(|_| RegisterError::Timeout {
            path: kubelet_sock.to_path_buf(),
        })?
}
