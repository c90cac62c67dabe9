//! [`SliceApi`] and [`ClaimStatusApi`] over a real API server, through kube-rs: both are
//! implemented for `kube::Client`.
//!
//! Invariants: every call is one HTTP request (no client-side rate limiting, no retries here: the
//! caller owns backoff); HTTP status codes map onto [`Error`]'s classes (409 → `Conflict`,
//! 404 → `NotFound`, 401/403 → `Denied` (credentials, RBAC), 400/422 and other 4xx → `Invalid`,
//! 408/429/5xx and transport failures → `Transient`). The slice watch is kube-runtime's [`watcher()`]: it lists, follows
//! `resourceVersion` and bookmarks across reconnects, and re-lists when the server answers
//! 410 Gone; each completed (re-)list is a [`SliceEvent::Restarted`].

use futures::future::BoxFuture;
use futures::stream::{BoxStream, StreamExt};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher::{self, watcher};

use super::{ClaimStatusApi, Error, Failure, Result, SliceApi, SliceEvent};

/// How long one watch request may stay open before the server closes it and we re-watch.
pub const WATCH_TIMEOUT_SECS: u32 = 290;

/// `spec.driver=…,spec.nodeName=…`, the field selector the API server indexes for slices (an
/// empty node selects the slices that name none).
fn slice_selector(driver: &str, node: &str) -> String {
    format!("spec.driver={driver},spec.nodeName={node}")
}

/// Classifies a kube-rs error by what to do about it, for [`SliceApi`]'s calls and a driver's
/// own alike; `what` names the operation and object for the message (`get node node-a`).
pub fn classify(what: &str, err: kube::Error) -> Error {
    match err {
        kube::Error::Api(status) => classify_status(what, &status),
        kube::Error::SerdeError(e) => Error::Invalid(Failure::caused(
            format!("{what}: unexpected response from the API server"),
            e,
        )),
        kube::Error::BuildRequest(e) => Error::Invalid(Failure::caused(what, e)),
        other => Error::Transient(Failure::caused(what, other)),
    }
}

fn classify_status(what: &str, status: &kube::core::Status) -> Error {
    let msg = format!(
        "{what}: {} (HTTP {}, {})",
        status.message, status.code, status.reason
    );
    match status.code {
        409 => Error::Conflict(msg.into()),
        404 => Error::NotFound(msg.into()),
        401 => Error::Denied(
            format!(
                "{msg}; the server did not accept the plugin's credentials: check its \
                 ServiceAccount token (or kubeconfig) is mounted, current and of this cluster"
            )
            .into(),
        ),
        403 => Error::Denied(
            format!(
                "{msg}; check RBAC: a Role or ClusterRole bound to the plugin's ServiceAccount \
                 must allow this request"
            )
            .into(),
        ),
        408 | 429 => Error::Transient(msg.into()),
        c if c >= 500 => Error::Transient(msg.into()),
        _ => Error::Invalid(msg.into()),
    }
}

fn name_of(slice: &ResourceSlice) -> String {
    match (&slice.metadata.name, &slice.metadata.generate_name) {
        (Some(n), _) => n.clone(),
        (None, Some(g)) => format!("{g}*"),
        (None, None) => "<unnamed>".into(),
    }
}

fn is_gone(status: &kube::core::Status) -> bool {
    status.code == 410 || status.reason == "Expired" || status.reason == "Gone"
}

/// One item of the kube-runtime watcher as a [`SliceEvent`]; `None` for what the publisher need
/// not hear: the objects of a (re-)list one by one (it re-reads them all after `Restarted`), and
/// a 410 Gone, after which the watcher re-lists by itself.
fn slice_event(item: watcher::Result<watcher::Event<ResourceSlice>>) -> Option<Result<SliceEvent>> {
    use watcher::Event;
    let name = |s: ResourceSlice| s.metadata.name.unwrap_or_default();
    match item {
        Ok(Event::InitDone) => Some(Ok(SliceEvent::Restarted)),
        Ok(Event::Init | Event::InitApply(_)) => None,
        Ok(Event::Apply(s)) => Some(Ok(SliceEvent::Applied(name(s)))),
        Ok(Event::Delete(s)) => Some(Ok(SliceEvent::Deleted(name(s)))),
        Err(watcher::Error::WatchError(s)) if is_gone(&s) => None,
        Err(e) => Some(Err(classify_watch(e))),
    }
}

/// Classifies a kube-runtime watcher error as [`classify`] does (the messages name
/// ResourceSlices, the watch this module runs).
pub fn classify_watch(err: watcher::Error) -> Error {
    match err {
        watcher::Error::InitialListFailed(e) => classify("list resourceslices for a watch", e),
        watcher::Error::WatchStartFailed(e) | watcher::Error::WatchFailed(e) => {
            classify("watch resourceslices", e)
        }
        watcher::Error::WatchError(s) => classify_status("watch resourceslices", &s),
        watcher::Error::NoResourceVersion => Error::Invalid(
            "watch resourceslices: the API server sent no metadata.resourceVersion".into(),
        ),
    }
}

impl SliceApi for Client {
    fn list_slices<'a>(
        &'a self,
        driver: &'a str,
        node: &'a str,
    ) -> BoxFuture<'a, Result<Vec<ResourceSlice>>> {
        Box::pin(async move {
            let lp = ListParams::default().fields(&slice_selector(driver, node));
            let list = Api::<ResourceSlice>::all(self.clone())
                .list(&lp)
                .await
                .map_err(|e| classify("list resourceslices", e))?;
            Ok(list.items)
        })
    }

    fn create_slice<'a>(
        &'a self,
        slice: &'a ResourceSlice,
    ) -> BoxFuture<'a, Result<ResourceSlice>> {
        Box::pin(async move {
            Api::<ResourceSlice>::all(self.clone())
                .create(&PostParams::default(), slice)
                .await
                .map_err(|e| classify(&format!("create resourceslice {}", name_of(slice)), e))
        })
    }

    fn replace_slice<'a>(
        &'a self,
        slice: &'a ResourceSlice,
    ) -> BoxFuture<'a, Result<ResourceSlice>> {
        Box::pin(async move {
            let name = slice.metadata.name.as_deref().ok_or_else(|| {
                Error::Invalid("replace resourceslice: the slice has no metadata.name".into())
            })?;
            Api::<ResourceSlice>::all(self.clone())
                .replace(name, &PostParams::default(), slice)
                .await
                .map_err(|e| classify(&format!("replace resourceslice {name}"), e))
        })
    }

    fn delete_slice<'a>(
        &'a self,
        name: &'a str,
        preconditions: &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Preconditions,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let dp = DeleteParams {
                preconditions: (preconditions.uid.is_some()
                    || preconditions.resource_version.is_some())
                .then(|| kube::api::Preconditions {
                    uid: preconditions.uid.clone(),
                    resource_version: preconditions.resource_version.clone(),
                }),
                ..DeleteParams::default()
            };
            Api::<ResourceSlice>::all(self.clone())
                .delete(name, &dp)
                .await
                .map(|_| ())
                .map_err(|e| classify(&format!("delete resourceslice {name}"), e))
        })
    }

    fn watch_slices<'a>(
        &'a self,
        driver: &'a str,
        node: &'a str,
    ) -> BoxStream<'a, Result<SliceEvent>> {
        let config = watcher::Config::default()
            .fields(&slice_selector(driver, node))
            .timeout(WATCH_TIMEOUT_SECS);
        watcher(Api::<ResourceSlice>::all(self.clone()), config)
            .filter_map(|item| std::future::ready(slice_event(item)))
            .boxed()
    }

    fn get_node<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Node>> {
        Box::pin(async move {
            Api::<Node>::all(self.clone())
                .get(name)
                .await
                .map_err(|e| classify(&format!("get node {name}"), e))
        })
    }
}

impl ClaimStatusApi for Client {
    fn apply_claim_status<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        field_manager: &'a str,
        patch: &'a serde_json::Value,
    ) -> BoxFuture<'a, Result<ResourceClaim>> {
        Box::pin(async move {
            let params = PatchParams::apply(field_manager).force();
            Api::<ResourceClaim>::namespaced(self.clone(), namespace)
                .patch_status(name, &params, &Patch::Apply(patch))
                .await
                .map_err(|e| {
                    classify(
                        &format!("apply status of resourceclaim {namespace}/{name}"),
                        e,
                    )
                })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16, reason: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure("boom", reason)
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn status_codes_map_to_error_classes() {
        assert!(matches!(
            classify("x", status(409, "Conflict")),
            Error::Conflict(_)
        ));
        assert!(matches!(
            classify("x", status(404, "NotFound")),
            Error::NotFound(_)
        ));
        assert!(matches!(
            classify("x", status(422, "Invalid")),
            Error::Invalid(_)
        ));
        assert!(matches!(
            classify("x", status(400, "BadRequest")),
            Error::Invalid(_)
        ));
        for code in [408, 429, 500, 503, 504] {
            assert!(
                matches!(classify("x", status(code, "")), Error::Transient(_)),
                "{code}"
            );
        }
        for code in [401, 403] {
            assert!(
                matches!(classify("x", status(code, "")), Error::Denied(_)),
                "{code}"
            );
        }
    }

    /// 401 and 403 say what to check, and not that the server is unavailable.
    #[test]
    fn refusals_name_credentials_or_rbac() {
        let forbidden = crate::report::chain(&classify(
            "create resourceslice s1",
            status(403, "Forbidden"),
        ))
        .to_string();
        assert!(
            forbidden.starts_with("denied by the API server: create resourceslice s1: boom"),
            "{forbidden}"
        );
        assert!(forbidden.contains("check RBAC"), "{forbidden}");
        assert!(forbidden.contains("ServiceAccount"), "{forbidden}");
        let unauthorized =
            crate::report::chain(&classify("get node n", status(401, "Unauthorized"))).to_string();
        assert!(unauthorized.contains("credentials"), "{unauthorized}");
        assert!(unauthorized.contains("token"), "{unauthorized}");
        for text in [forbidden, unauthorized] {
            assert!(!text.contains("unavailable"), "{text}");
        }
    }

    #[test]
    fn messages_name_the_operation_and_the_server_message() {
        let e = classify("replace resourceslice s1", status(409, "Conflict"));
        let text = e.to_string();
        assert!(text.contains("replace resourceslice s1"), "{text}");
        assert!(text.contains("boom"), "{text}");
        assert!(text.contains("409"), "{text}");
    }

    #[test]
    fn a_transport_error_stays_the_kube_error_underneath() {
        let e = classify(
            "list resourceslices",
            kube::Error::Service("connection refused".into()),
        );
        assert!(matches!(e, Error::Transient(_)), "{e:?}");
        assert_eq!(e.to_string(), "API server unavailable: list resourceslices");
        let source = std::error::Error::source(&e).expect("the kube error is the source");
        assert!(source.downcast_ref::<kube::Error>().is_some(), "{source:?}");
        // (kube's own ServiceError repeats its source; ours says the operation once.)
        let chain = crate::report::chain(&e).to_string();
        assert!(
            chain.starts_with(
                "API server unavailable: list resourceslices: ServiceError: connection refused"
            ),
            "{chain}"
        );
    }

    #[test]
    fn gone_is_recognised_by_code_or_reason() {
        assert!(is_gone(
            &kube::core::Status::failure("old", "Expired").with_code(410)
        ));
        assert!(is_gone(&kube::core::Status::failure("old", "Gone")));
        assert!(!is_gone(
            &kube::core::Status::failure("x", "Conflict").with_code(409)
        ));
    }

    #[test]
    fn watcher_items_become_slice_events() {
        use watcher::Event;
        let slice = |name: &str| ResourceSlice {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Default::default(),
        };
        assert_eq!(
            slice_event(Ok(Event::InitDone)).unwrap().unwrap(),
            SliceEvent::Restarted
        );
        assert!(slice_event(Ok(Event::Init)).is_none());
        assert!(slice_event(Ok(Event::InitApply(slice("a")))).is_none());
        assert_eq!(
            slice_event(Ok(Event::Apply(slice("a")))).unwrap().unwrap(),
            SliceEvent::Applied("a".into())
        );
        assert_eq!(
            slice_event(Ok(Event::Delete(slice("b")))).unwrap().unwrap(),
            SliceEvent::Deleted("b".into())
        );
        // 410 Gone: the watcher re-lists by itself and reports that as InitDone.
        let gone = kube::core::Status::failure("too old", "Expired").with_code(410);
        assert!(slice_event(Err(watcher::Error::WatchError(gone.boxed()))).is_none());
        let other = kube::core::Status::failure("boom", "InternalError").with_code(500);
        assert!(matches!(
            slice_event(Err(watcher::Error::WatchError(other.boxed()))),
            Some(Err(Error::Transient(_)))
        ));
    }

    #[test]
    fn selector_names_driver_and_node() {
        assert_eq!(
            slice_selector("gpu.nvidia.com", "node-a"),
            "spec.driver=gpu.nvidia.com,spec.nodeName=node-a"
        );
    }
}
