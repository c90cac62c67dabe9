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

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::resource::v1::DeviceClass;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::api::ClusterApi;
use crate::deviceplugin::{Mapped, Options, nvconfig, path_for, resources};

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

/// Why `nvdra inventory -o paths` failed.
#[derive(Debug, thiserror::Error)]
pub enum PathsError {
    #[error(transparent)]
    Config(#[from] nvconfig::ConfigError),
    #[error("cannot compute the device-plugin resources")]
    Resources(#[from] resources::Error),
    #[error("cannot ask the API server which path serves what (mode auto)")]
    Api(#[from] crate::api::Error),
}

/// `nvdra inventory -o paths`: one line per resource name the device-plugin path could serve,
/// saying which path serves it under the configured mode, then the DRA line.
pub async fn render_paths(
    config: &crate::config::Config,
    inv: &crate::inventory::Inventory,
) -> Result<String, PathsError> {
    use crate::config::Mode;
    let mut options = match &config.device_plugin_config {
        Some(p) => nvconfig::load(p)?,
        None => Options::default(),
    };
    // As `nvdra run` computes them beside DRA (`daemon::device_plugin`).
    options.dynamic_mig =
        matches!(config.mode, Mode::Both | Mode::Auto) && config.dynamic_mig.enabled();
    let res = resources::resources(inv, &options)?;
    let (dra, mapped) = match config.mode {
        Mode::Dra => (Ok(()), None),
        Mode::DevicePlugin => (Err("mode device-plugin"), Some(Mapped::new())),
        Mode::Both => (Ok(()), Some(Mapped::new())),
        Mode::Auto => {
            let api = crate::api::connect(&config.api).await?;
            if api.dra_served().await? {
                let first = api.watch_device_classes().next().await.transpose()?;
                (Ok(()), Some(mapped(&first.unwrap_or_default())))
            } else {
                (
                    Err("the API server does not serve resource.k8s.io/v1"),
                    Some(Mapped::new()),
                )
            }
        }
    };
    let mut out = format!("{:<32} PATH\n", "RESOURCE");
    for r in &res {
        let path = match &mapped {
            None => "none (mode dra: the device plugin is off)".to_string(),
            Some(m) => path_for(m, r.name.as_str()),
        };
        out.push_str(&format!("{:<32} {path}\n", r.name.as_str()));
    }
    let dra_line = match dra {
        Ok(()) => format!("ResourceSlices of driver {}", config.driver_name),
        Err(why) => format!("none ({why})"),
    };
    out.push_str(&format!("{:<32} {dra_line}\n", "DRA"));
    Ok(out)
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
