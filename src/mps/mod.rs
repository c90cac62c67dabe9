//! The MPS host: the node's MPS control daemons, run by `nvdra mps-host` in a DaemonSet of their
//! own, so that upgrading, restarting or killing the plugin never touches a running share.
//!
//! The plugin and the host share nothing but a directory (`--mps-root`, a host tmpfs) and talk
//! through it ([`dir`] is the protocol):
//!
//! - the plugin asks for a daemon by writing `<root>/<id>/daemon.json` (which devices, whether
//!   multi-user, for whom) and releases it by removing that file;
//! - the host ([`host`]) runs one `nvidia-cuda-mps-control -f` per `daemon.json`, with the pipe,
//!   log and shm directories of `<id>/`, in a private mount namespace whose `/dev/shm` is
//!   `<id>/shm` ([`ns`]), restarts it when it exits while wanted, and on release sends `quit`
//!   (SIGKILL after a deadline) and removes the directory;
//! - either side asks a daemon whether it is alive the one way that proves it: it answers
//!   `get_server_list` through `nvidia-cuda-mps-control` within a deadline ([`control`]).
//!
//! Invariants:
//! - A daemon is alive only when it answers; no file's existence counts.
//! - Every child process call (`alive`, `quit`) has a deadline.
//! - The host's daemons are its children: they end with it (the host is replaced only as a
//!   node-drain step), and a directory whose `daemon.json` was written in another boot is stale.
//! - `<id>` is short and fixed-length (`g-`/`c-` and 12 hex digits), so `<root>/<id>/pipe/control`
//!   stays far under the 107 bytes of a socket path.
//!
//! [`gate`] is the other side of the plugin's MPS claims: the runtime hook that lets a share's
//! container start only while its daemon answers with a server up.
//!
//! [`standin`] is a stand-in for `nvidia-cuda-mps-control` (daemon, server, CLI and a CUDA client)
//! as real processes, for tests and the demo on nodes without NVIDIA's tools.

pub mod control;
pub mod dir;
pub mod gate;
pub mod host;
mod ns;
#[cfg(feature = "tools")]
pub mod standin;
