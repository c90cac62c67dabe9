//! The Unix sockets the kubelet dials: binding, removal on every way out ([`Bound`],
//! [`OwnedSockets`]), the client side used by the demo, tests and benchmarks, and — below every
//! gRPC server run on such a socket — the adapter that makes h2 accept what the kubelet
//! sends.
//!
//! The kubelet is a grpc-go program. It sends the socket path as `:authority`, percent-encoded
//! (`%2Fvar%2Flib%2Fkubelet%2F…`) by recent grpc-go and raw (`/var/lib/…`) by older releases;
//! grpcio sends `var%2Flib%2F…`. h2 parses `:authority` with `http::uri::Authority` and answers
//! such a request with `RST_STREAM(PROTOCOL_ERROR)`, so without [`authority`] the kubelet could
//! neither register nor prepare a claim. Every server goes through
//! [`incoming`], so the fix exists once; this module knows no gRPC service.

pub mod authority;
mod hpack;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::server::{Connected, UdsConnectInfo};

pub use authority::Rewriter;

/// The longest path a Unix socket address holds (`sun_path` is 108 bytes with the NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// Why a kubelet-facing socket could not be bound.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Binding (or preparing its directory) failed.
    #[error(
        "cannot listen on {path} (is the kubelet directory mounted into the pod, and writable?)"
    )]
    Bind {
        /// The socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    #[error(
        "socket path {path} is {len} bytes, over the {MAX_SOCKET_PATH}-byte limit of Unix sockets; use a shorter --kubelet-root"
    )]
    /// The path does not fit a Unix socket address.
    PathTooLong {
        /// The socket.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
    },
}

/// Unlinks a stale socket and binds a new one (creating the directory).
pub fn bind(path: &Path) -> Result<UnixListener, Error> {
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(Error::PathTooLong {
            path: path.to_path_buf(),
            len,
        });
    }
    let berr = |source| Error::Bind {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(berr)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(berr(e)),
    }
    UnixListener::bind(path).map_err(berr)
}

/// A socket this instance bound: its path and the identity (device, inode) of the file bound
/// there. Instances name their sockets apart (by pod UID); in addition [`Bound::remove`] unlinks
/// the path only while it is still that file, so a socket another instance bound there since is
/// left alone — unless it got the very inode number ours freed, which nothing here can tell.
#[derive(Clone, Debug)]
pub struct Bound {
    path: PathBuf,
    /// `None` when the socket could not be stat'ed right after binding: nothing to remove then.
    id: Option<(u64, u64)>,
}

impl Bound {
    /// Records the socket just bound at `path` (call right after [`bind`]).
    pub fn adopt(path: &Path) -> Self {
        let id = match std::fs::symlink_metadata(path) {
            Ok(m) => Some((m.dev(), m.ino())),
            // Bound but gone already: nothing of ours to remove later.
            Err(e) => {
                tracing::warn!(socket = %path.display(), error = %e, "cannot stat a socket just bound");
                None
            }
        };
        Bound {
            path: path.to_path_buf(),
            id,
        }
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Unlinks the socket if the path still holds the file that was bound; true if it did.
    pub fn remove(&self) -> bool {
        let Some(id) = self.id else { return false };
        match std::fs::symlink_metadata(&self.path) {
            Ok(m) if (m.dev(), m.ino()) == id => match std::fs::remove_file(&self.path) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(socket = %self.path.display(), error = %e, "cannot remove socket");
                    false
                }
            },
            // Removed already, or replaced by another instance's.
            _ => false,
        }
    }
}

/// The sockets this instance bound, each [removed](Bound::remove) when this is dropped: on every
/// way out of the code that owns it — a failed start, a drain, a forced exit, a panic.
#[derive(Debug, Default)]
pub struct OwnedSockets(Vec<Bound>);

impl OwnedSockets {
    /// Takes ownership of the socket just bound at `path`; the returned handle lets its server
    /// remove it at shutdown as well.
    pub fn adopt(&mut self, path: &Path) -> Bound {
        let bound = Bound::adopt(path);
        self.0.push(bound.clone());
        bound
    }
}

impl Drop for OwnedSockets {
    fn drop(&mut self) {
        for bound in self.0.drain(..) {
            bound.remove();
        }
    }
}

/// The connections of `listener`, each behind the `:authority` adapter: what a gRPC server on a
/// kubelet-facing socket serves (`Server::serve_with_incoming_shutdown(incoming(l), …)`).
pub fn incoming(
    listener: UnixListener,
) -> impl Stream<Item = std::io::Result<KubeletStream>> + Send + 'static {
    use futures::StreamExt;
    UnixListenerStream::new(listener).map(|conn| conn.map(KubeletStream::new))
}

/// A client channel to a gRPC server on a Unix socket (the URI is a placeholder tonic requires;
/// the connector ignores it): the client side of tests, demos and benchmarks.
pub async fn connect(path: &Path) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    tonic::transport::Endpoint::from_static("http://[::]:50051")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
}

/// A connection from the kubelet: what the client sends passes through a [`Rewriter`] before
/// h2 reads it; what the server writes goes out untouched.
pub struct KubeletStream {
    inner: UnixStream,
    rewriter: Rewriter,
    /// Rewritten bytes not yet read by h2, from `pos`.
    out: Vec<u8>,
    pos: usize,
    /// Scratch space for reads from the socket.
    scratch: Box<[u8]>,
    eof: bool,
}

/// Bytes read from the socket per call; a multiple of the 16 KiB default HTTP/2 frame.
const READ_CHUNK: usize = 32 * 1024;

impl KubeletStream {
    /// The kubelet's connection `inner`, with its `:authority` made acceptable to h2.
    pub fn new(inner: UnixStream) -> Self {
        KubeletStream {
            inner,
            rewriter: Rewriter::server(),
            out: Vec::with_capacity(READ_CHUNK),
            pos: 0,
            scratch: vec![0; READ_CHUNK].into_boxed_slice(),
            eof: false,
        }
    }
}

impl AsyncRead for KubeletStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.pos < this.out.len() {
                let n = buf.remaining().min(this.out.len() - this.pos);
                buf.put_slice(&this.out[this.pos..this.pos + n]);
                this.pos += n;
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            this.out.clear();
            this.pos = 0;
            let mut read = ReadBuf::new(&mut this.scratch);
            match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {}
            }
            let filled = read.filled();
            if filled.is_empty() {
                // The peer closed: hand h2 whatever partial frame is buffered, so it reports a
                // truncated connection as it would without us.
                this.rewriter.finish(&mut this.out);
                this.eof = true;
            } else {
                this.rewriter.feed(filled, &mut this.out);
            }
        }
    }
}

impl AsyncWrite for KubeletStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl Connected for KubeletStream {
    type ConnectInfo = UdsConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::{Bound, OwnedSockets};

    #[test]
    fn owned_sockets_are_removed_on_drop_unless_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let (ours, replaced) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
        let _a = std::os::unix::net::UnixListener::bind(&ours).unwrap();
        let _b = std::os::unix::net::UnixListener::bind(&replaced).unwrap();
        let mut owned = OwnedSockets::default();
        owned.adopt(&ours);
        owned.adopt(&replaced);
        // Another instance's socket takes the place of `b.sock` (bound beside it and renamed over
        // it, so it cannot get the inode number `b.sock` frees).
        let theirs = dir.path().join("theirs.sock");
        let _theirs = std::os::unix::net::UnixListener::bind(&theirs).unwrap();
        std::fs::rename(&theirs, &replaced).unwrap();
        drop(owned);
        assert!(!ours.exists());
        assert!(replaced.exists(), "another instance's socket was removed");
    }

    #[test]
    fn a_server_removes_only_its_own_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dra.sock");
        let _ours = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let bound = Bound::adopt(&path);
        // A second instance rebinds the path (as `bind` does: unlink, then bind).
        std::fs::remove_file(&path).unwrap();
        let theirs = dir.path().join("theirs.sock");
        let _theirs = std::os::unix::net::UnixListener::bind(&theirs).unwrap();
        std::fs::rename(&theirs, &path).unwrap();
        assert!(!bound.remove());
        assert!(path.exists(), "another instance's socket was removed");

        let other = dir.path().join("reg.sock");
        let _l = std::os::unix::net::UnixListener::bind(&other).unwrap();
        let bound = Bound::adopt(&other);
        assert!(bound.remove());
        assert!(!other.exists());
        // Twice is harmless: the server removes it, then the guard finds it gone.
        assert!(!bound.remove());
    }
}
