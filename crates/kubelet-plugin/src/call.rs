//! The kubelet's call a driver's `prepare` or `unprepare` runs in, reached from inside it with
//! [`current`] (the [`Driver`](crate::Driver) methods take no context parameter): the call's
//! request id, the kubelet's deadline, and a token cancelled when the kubelet gives up on the
//! call (its deadline passes, or it drops the request) or the plugin stops.
//!
//! The library never aborts a driver's call: it runs to its end even after the kubelet stopped
//! waiting, so that its effect is there for the next one. The token lets a driver stop early
//! where stopping is safe (a long wait, a retry loop), or leave a note of what it abandoned.
//!
//! ```
//! use kubelet_plugin::{BoxError, PrepareClaim, PrepareResults, call};
//!
//! async fn prepare(claims: Vec<PrepareClaim>) -> Result<PrepareResults, BoxError> {
//!     let call = call::current().expect("inside a prepare the library runs");
//!     tracing::info!(request = call.id(), deadline = ?call.deadline(), "preparing");
//!     tokio::select! {
//!         _ = call.cancelled() => Err("the kubelet gave up; it will call again".into()),
//!         done = slow_setup(&claims) => done,
//!     }
//! }
//! # async fn slow_setup(_: &[PrepareClaim]) -> Result<PrepareResults, BoxError> { Ok(vec![]) }
//! # let call = call::Call::new("test", None, kubelet_plugin::CancellationToken::new());
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
//! #     .block_on(call.scope(prepare(vec![]))).unwrap();
//! ```
//!
//! The context belongs to the task the library runs the call in: a driver that spawns tasks of
//! its own clones the [`Call`] into them (or runs them inside [`Call::scope`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

tokio::task_local! {
    static CURRENT: Call;
}

/// One kubelet call (`NodePrepareResources` or `NodeUnprepareResources`) as the driver sees it.
#[derive(Clone, Debug)]
pub struct Call {
    id: Arc<str>,
    deadline: Option<Instant>,
    cancel: CancellationToken,
}

/// The call the current task runs in: `Some` inside a driver's `prepare` or `unprepare` that
/// the library called (and inside [`Call::scope`]), `None` elsewhere.
pub fn current() -> Option<Call> {
    CURRENT.try_with(Call::clone).ok()
}

impl Call {
    /// A call with request id `id`, the kubelet's `deadline`, cancelled with `cancel`: what the
    /// library makes for each call, and what a driver's own tests run its code in
    /// ([`Call::scope`]).
    pub fn new(
        id: impl Into<Arc<str>>,
        deadline: Option<Instant>,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            id: id.into(),
            deadline,
            cancel,
        }
    }

    /// The request id the library gave the call: 16 hex digits, in the call's tracing span
    /// (`request_id`) and so in every line logged inside it.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// When the kubelet stops waiting for an answer, from the call's `grpc-timeout` (the kubelet
    /// sends 45 s); `None` when the caller sent none.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// The token cancelled when the kubelet gives up on the call or the plugin stops.
    pub fn token(&self) -> &CancellationToken {
        &self.cancel
    }

    /// Whether the kubelet gave up on the call or the plugin stopped.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Completes when the kubelet gives up on the call or the plugin stops.
    pub fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.cancel.cancelled()
    }

    /// Runs `f` with this call as [`current`].
    pub fn scope<F: Future>(self, f: F) -> impl Future<Output = F::Output> {
        CURRENT.scope(self, f)
    }
}

/// A new request id: 16 random hex digits, unique enough to find one call in a node's logs.
pub(crate) fn new_id() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// The `grpc-timeout` header's duration (gRPC over HTTP/2: at most 8 digits, then one of
/// `H M S m u n`); `None` when absent or malformed.
pub(crate) fn grpc_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<Duration> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let unit = value.chars().last()?;
    let digits = &value[..value.len() - unit.len_utf8()];
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // At most 8 digits: fits a u64, and any unit's product below.
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        'H' => Duration::from_secs(n * 3600),
        'M' => Duration::from_secs(n * 60),
        'S' => Duration::from_secs(n),
        'm' => Duration::from_millis(n),
        'u' => Duration::from_micros(n),
        'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeout(v: &str) -> Option<Duration> {
        let mut m = tonic::metadata::MetadataMap::new();
        m.insert("grpc-timeout", v.parse().unwrap());
        grpc_timeout(&m)
    }

    #[test]
    fn grpc_timeout_units() {
        assert_eq!(timeout("45S"), Some(Duration::from_secs(45)));
        assert_eq!(timeout("44999m"), Some(Duration::from_millis(44999)));
        assert_eq!(timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(timeout("99999999n"), Some(Duration::from_nanos(99_999_999)));
        for bad in ["", "S", "123456789S", "12x", "-1S", "1.5S", "12"] {
            assert_eq!(timeout(bad), None, "{bad:?}");
        }
        assert_eq!(grpc_timeout(&tonic::metadata::MetadataMap::new()), None);
    }

    /// What tonic's own client sends for a deadline reads back as that deadline.
    #[test]
    fn tonics_encoding_reads_back() {
        let mut r = tonic::Request::new(());
        r.set_timeout(Duration::from_millis(1500));
        let got = grpc_timeout(r.metadata()).unwrap();
        assert_eq!(got, Duration::from_millis(1500));
    }

    #[tokio::test]
    async fn current_inside_scope_only() {
        assert!(current().is_none());
        let call = Call::new("abc", None, CancellationToken::new());
        let id = call
            .clone()
            .scope(async { current().map(|c| c.id().to_string()) })
            .await;
        assert_eq!(id.as_deref(), Some("abc"));
        assert!(current().is_none());
    }

    #[test]
    fn ids_are_16_hex_digits() {
        let id = new_id();
        assert_eq!(id.len(), 16);
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
    }
}
