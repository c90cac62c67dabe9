//! The Unix sockets the kubelet dials: binding, the client side used by the demo, tests and
//! benchmarks, and — below every gRPC server nvdra runs on such a socket — the adapter that makes
//! h2 accept what the kubelet sends.
//!
//! The kubelet is a grpc-go program. It sends the socket path as `:authority`, percent-encoded
//! (`%2Fvar%2Flib%2Fkubelet%2F…`) by recent grpc-go and raw (`/var/lib/…`) by older releases;
//! grpcio sends `var%2Flib%2F…`. h2 parses `:authority` with `http::uri::Authority` and answers
//! such a request with `RST_STREAM(PROTOCOL_ERROR)`, so without [`authority`] the kubelet could
//! neither register nor prepare a claim (`reference/kubelet-wire.md`). Every server goes through
//! [`incoming`], so the fix exists once; this module knows no gRPC service.

pub mod authority;

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

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot listen on {path}")]
    Bind {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "socket path {path} is {len} bytes, over the {MAX_SOCKET_PATH}-byte limit of Unix sockets; use a shorter --kubelet-root"
    )]
    PathTooLong { path: PathBuf, len: usize },
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

/// The connections of `listener`, each behind the `:authority` adapter: what a gRPC server on a
/// kubelet-facing socket serves (`Server::serve_with_incoming_shutdown(incoming(l), …)`).
pub fn incoming(
    listener: UnixListener,
) -> impl Stream<Item = std::io::Result<KubeletStream>> + Send + 'static {
    use futures::StreamExt;
    UnixListenerStream::new(listener).map(|conn| conn.map(KubeletStream::new))
}

/// The connections of `listener` as they are, without the adapter. Only for the benchmark that
/// measures what the adapter costs.
#[doc(hidden)]
pub fn incoming_unadapted(listener: UnixListener) -> UnixListenerStream {
    UnixListenerStream::new(listener)
}

/// A client channel to a gRPC server on a Unix socket (the URI is a placeholder tonic requires;
/// the connector ignores it). For `nvdra demo`, tests and benchmarks.
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
