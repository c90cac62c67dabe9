//! The MPS start gate in a claim's spec: a `createRuntime` hook, `nvdra mps-gate`, that the
//! container runtime runs on the host at every start of every container of an MPS claim (a
//! restart inside a running pod included, which never passes through prepare). It lets the
//! container start only when the claim's MPS control daemon answers and an MPS server is up
//! for it ([`crate::mps::gate`] is the hook's side).
//!
//! Why at the runtime and not only at prepare: a CUDA process that cannot reach its daemon runs
//! without MPS, as a plain context with no limit, and in `EXCLUSIVE_PROCESS` it then keeps the
//! GPU from every share's server. A container that starts while the daemon is down (killed,
//! restarting, its host replaced) would do just that; with the gate it does not start, and the
//! kubelet retries it with its back-off until the daemon is back.

use std::path::{Path, PathBuf};

use super::Hook;

/// The OCI hook point: on the host, once the container is created, before its process runs.
const CREATE_RUNTIME: &str = "createRuntime";

/// The hook's subcommand of nvdra.
pub const SUBCOMMAND: &str = "mps-gate";

/// What the gate needs, as host paths: nvdra's binary installed on the host, and the driver's
/// `nvidia-cuda-mps-control`, through which it asks the daemon.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gate {
    pub binary: PathBuf,
    pub control: PathBuf,
}

impl Gate {
    /// The hook for the daemon whose pipe directory (a host path) is `pipe`.
    pub fn hook(&self, pipe: &Path) -> Hook {
        Hook {
            hook_name: CREATE_RUNTIME.into(),
            path: self.binary.display().to_string(),
            args: vec![
                "nvdra".into(),
                SUBCOMMAND.into(),
                "--control".into(),
                self.control.display().to_string(),
                "--pipe".into(),
                pipe.display().to_string(),
            ],
            env: Vec::new(),
        }
    }
}
