//! Kubelet plugin registration: a `pluginregistration.Registration` server on a socket in
//! `<kubelet root>/plugins_registry/`, which the kubelet discovers by inotify.
//!
//! `GetInfo` answers type `DRAPlugin`, the driver name, the absolute DRA socket path and the
//! served versions in the kubelet's preference order. The DRA socket must already be serving when
//! the registration socket appears (the daemon starts this server second). Each instance removes
//! only its own socket.

use std::path::{Path, PathBuf};

use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::error::Error;
use crate::proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
    registration_server::{Registration, RegistrationServer},
};
use crate::socket::{self, MAX_SOCKET_PATH};

/// `supported_versions`, in the order the kubelet should pick from: the DRA services, then the
/// health services, newest first.
pub const SUPPORTED_VERSIONS: [&str; 5] = [
    "v1.DRAPlugin",
    "v1beta1.DRAPlugin",
    crate::health::SERVICES[0],
    crate::health::SERVICES[1],
    crate::health::SERVICES[2],
];

/// Called with the kubelet's verdict on each registration (`true`: registered).
pub type RegistrationHook = std::sync::Arc<dyn Fn(bool) + Send + Sync>;

/// Socket paths of one plugin instance.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sockets {
    /// The registration socket, in the kubelet's plugin registry directory.
    pub registration: PathBuf,
    /// The DRA socket, in the driver's plugin directory.
    pub dra: PathBuf,
}

impl Sockets {
    /// `<registry>/<driver>-reg.sock` and `<plugin dir>/dra.sock`; with a pod UID (rolling
    /// updates) `<driver>-<uid>-reg.sock` and `dra-<uid>.sock`, so two instances never share one.
    /// A path that would exceed the 107 bytes a Unix socket address holds uses a 16-hex-digit
    /// hash of the UID instead (`<driver>-<hash>-reg.sock`, `dra-<hash>.sock`); if even that is
    /// too long, binding reports it.
    pub fn new(
        registry_dir: &Path,
        plugin_dir: &Path,
        driver: &str,
        pod_uid: Option<&str>,
    ) -> Self {
        let Some(uid) = pod_uid else {
            return Sockets {
                registration: registry_dir.join(format!("{driver}-reg.sock")),
                dra: plugin_dir.join("dra.sock"),
            };
        };
        let fits = |p: &PathBuf| p.as_os_str().len() <= MAX_SOCKET_PATH;
        let short = format!("{:016x}", fnv1a64(uid.as_bytes()));
        let pick = |make: &dyn Fn(&str) -> PathBuf| {
            let full = make(uid);
            if fits(&full) { full } else { make(&short) }
        };
        Sockets {
            registration: pick(&|id| registry_dir.join(format!("{driver}-{id}-reg.sock"))),
            dra: pick(&|id| plugin_dir.join(format!("dra-{id}.sock"))),
        }
    }
}

/// FNV-1a, 64 bits: a stable short name for a long pod UID (not a security boundary).
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

struct Service {
    driver: String,
    endpoint: String,
    registered: Option<RegistrationHook>,
}

#[tonic::async_trait]
impl Registration for Service {
    async fn get_info(
        &self,
        _request: Request<InfoRequest>,
    ) -> Result<Response<PluginInfo>, Status> {
        tracing::debug!("registration GetInfo");
        Ok(Response::new(PluginInfo {
            r#type: "DRAPlugin".into(),
            name: self.driver.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|s| s.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let RegistrationStatus {
            plugin_registered,
            error,
        } = request.into_inner();
        if plugin_registered {
            tracing::info!(driver = %self.driver, endpoint = %self.endpoint, "registered with the kubelet");
        } else {
            tracing::error!(driver = %self.driver, %error,
                "the kubelet refused the registration; check the kubelet's DRA support and its log");
        }
        if let Some(hook) = &self.registered {
            hook(plugin_registered);
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// The registration server of one instance.
pub(crate) struct Registrar {
    pub(crate) driver: String,
    pub(crate) sockets: Sockets,
    /// Hears the kubelet's verdict on the registration (a readiness input).
    pub(crate) registered: Option<RegistrationHook>,
    /// The driver's layer around the server ([`crate::Options::layer`]).
    pub(crate) layer: Option<crate::layer::ServerLayer>,
}

impl Registrar {
    /// Binds the registration socket (unlinking a stale one). Call once the DRA socket serves.
    pub(crate) fn bind(&self) -> Result<UnixListener, Error> {
        Ok(socket::bind(&self.sockets.registration)?)
    }

    /// Serves until shutdown, then removes the socket `bound` (if it is still the one bound: see
    /// [`socket::Bound::remove`]). The kubelet's verdict goes to `registered`.
    pub(crate) async fn run(
        self,
        listener: UnixListener,
        bound: socket::Bound,
        shutdown: CancellationToken,
    ) -> Result<(), Error> {
        let service = Service {
            driver: self.driver,
            endpoint: self.sockets.dra.display().to_string(),
            registered: self.registered,
        };
        let result = tonic::transport::Server::builder()
            .layer(crate::layer::server_layer(self.layer))
            .add_service(RegistrationServer::new(service))
            .serve_with_incoming_shutdown(socket::incoming(listener), shutdown.cancelled())
            .await;
        bound.remove();
        tracing::info!(socket = %bound.path().display(), "registration server stopped");
        result.map_err(|source| Error::Serve {
            path: bound.path().to_path_buf(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_names() {
        let s = Sockets::new(
            Path::new("/var/lib/kubelet/plugins_registry"),
            Path::new("/var/lib/kubelet/plugins/gpu.nvidia.com"),
            "gpu.nvidia.com",
            None,
        );
        assert_eq!(
            s.registration,
            PathBuf::from("/var/lib/kubelet/plugins_registry/gpu.nvidia.com-reg.sock")
        );
        assert_eq!(
            s.dra,
            PathBuf::from("/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock")
        );
        let uid = "0f2d5a3c-1234-4bcd-9876-0123456789ab";
        let s = Sockets::new(
            Path::new("/var/lib/kubelet/plugins_registry"),
            Path::new("/var/lib/kubelet/plugins/gpu.nvidia.com"),
            "gpu.nvidia.com",
            Some(uid),
        );
        assert!(
            s.registration
                .ends_with(format!("gpu.nvidia.com-{uid}-reg.sock"))
        );
        assert!(s.dra.ends_with(format!("dra-{uid}.sock")));
        // The default layout fits the Unix socket limit with room to spare.
        assert!(s.registration.as_os_str().len() < 108);
        assert!(s.dra.as_os_str().len() < 108);
    }

    #[test]
    fn long_paths_use_a_hash_of_the_uid() {
        let deep = PathBuf::from(format!("/{}", "k".repeat(40)));
        let uid = "0f2d5a3c-1234-4bcd-9876-0123456789ab";
        let s = Sockets::new(
            &deep.join("plugins_registry"),
            &deep.join("plugins/gpu.nvidia.com"),
            "gpu.nvidia.com",
            Some(uid),
        );
        for p in [&s.registration, &s.dra] {
            assert!(p.as_os_str().len() <= MAX_SOCKET_PATH, "{}", p.display());
            assert!(!p.to_str().unwrap().contains(uid), "{}", p.display());
        }
        // Stable, and different for another pod.
        let again = Sockets::new(
            &deep.join("plugins_registry"),
            &deep.join("plugins/gpu.nvidia.com"),
            "gpu.nvidia.com",
            Some(uid),
        );
        assert_eq!(s, again);
        let other = Sockets::new(
            &deep.join("plugins_registry"),
            &deep.join("plugins/gpu.nvidia.com"),
            "gpu.nvidia.com",
            Some("another-pod"),
        );
        assert_ne!(s.registration, other.registration);
    }
}
