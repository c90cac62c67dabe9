//! `--mode auto`: which resource names the device plugin serves beside DRA.
//!
//! Since Kubernetes 1.34 (DRAExtendedResource, KEP-5004) a DeviceClass with
//! `spec.extendedResourceName: nvidia.com/gpu` lets the scheduler satisfy a legacy
//! `nvidia.com/gpu` limit through DRA — but only on nodes whose allocatable does not list that
//! name from a device plugin. So where the API server serves `resource.k8s.io/v1`, DRA is served
//! and the device plugin registers only the names no DeviceClass maps; where it does not, the
//! device plugin serves everything. [`follow`] keeps the mapped names current from a DeviceClass
//! watch; the device plugin stops serving a name once a class maps it and serves it again when
//! none does.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::resource::v1::DeviceClass;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::api::ClusterApi;

/// Extended resource name → the DeviceClasses that map it (sorted, never empty).
pub type Mapped = BTreeMap<String, Vec<String>>;

const RETRY_START: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// The extended resource names `classes` map, with the classes mapping each.
pub fn mapped(classes: &[DeviceClass]) -> Mapped {
    let mut out = Mapped::new();
    for c in classes {
        if let Some(name) = &c.spec.extended_resource_name {
            out.entry(name.clone())
                .or_default()
                .push(c.metadata.name.clone().unwrap_or_default());
        }
    }
    for v in out.values_mut() {
        v.sort();
    }
    out
}

/// Which path serves `name`, for logs and `nvdra inventory`.
pub fn path_for(mapped: &Mapped, name: &str) -> String {
    match mapped.get(name) {
        Some(classes) => format!(
            "DRA (DeviceClass {} maps it via spec.extendedResourceName)",
            classes.join(", ")
        ),
        None => "device plugin".to_string(),
    }
}

/// Follows the DeviceClasses until `shutdown`, sending the mapped names whenever they change.
/// A failed watch keeps the last mapping and is restarted with backoff (1 s up to 30 s).
pub async fn follow(
    api: Arc<dyn ClusterApi>,
    tx: watch::Sender<Mapped>,
    shutdown: CancellationToken,
) {
    let mut delay = RETRY_START;
    let mut first = true;
    loop {
        let mut stream = api.watch_device_classes();
        loop {
            let item = tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                item = stream.next() => item,
            };
            match item {
                Some(Ok(classes)) => {
                    delay = RETRY_START;
                    let now = mapped(&classes);
                    // The first list is always sent: the daemon waits for it before serving.
                    let force = std::mem::take(&mut first);
                    tx.send_if_modified(|cur| {
                        if *cur == now && !force {
                            return false;
                        }
                        tracing::info!(mapped = ?now, "DeviceClasses changed: extended resource names DRA serves");
                        *cur = now;
                        true
                    });
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %crate::report::chain(&e), retry_in = ?delay,
                        "cannot watch DeviceClasses; keeping the last mapping");
                    break;
                }
                None => break,
            }
        }
        drop(stream);
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(RETRY_MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::DeviceClassSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn class(name: &str, ext: Option<&str>) -> DeviceClass {
        DeviceClass {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: DeviceClassSpec {
                extended_resource_name: ext.map(String::from),
                ..Default::default()
            },
        }
    }

    #[test]
    fn only_classes_with_an_extended_resource_name_map_one() {
        let m = mapped(&[
            class("plain", None),
            class("gpu-b", Some("nvidia.com/gpu")),
            class("gpu-a", Some("nvidia.com/gpu")),
            class("mig", Some("nvidia.com/mig-1g.10gb")),
        ]);
        assert_eq!(
            m,
            Mapped::from([
                (
                    "nvidia.com/gpu".into(),
                    vec!["gpu-a".into(), "gpu-b".into()]
                ),
                ("nvidia.com/mig-1g.10gb".into(), vec!["mig".into()]),
            ])
        );
        assert_eq!(
            path_for(&m, "nvidia.com/gpu"),
            "DRA (DeviceClass gpu-a, gpu-b maps it via spec.extendedResourceName)"
        );
        assert_eq!(path_for(&m, "nvidia.com/gpu.shared"), "device plugin");
    }
}
