//! The serving loop ([`DevicePlugin::run`]): the servers' first lists, then one handler per
//! [`Wake`] until shutdown, and what each re-read of the inventory changes (the lists sent to
//! the open streams, the CDI spec when the devices, not their health, changed).

use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::deviceplugin::allocate::Context;
use crate::deviceplugin::resources::{self, Resource};
use crate::inventory::{self, Inventory};

use super::registration::{KUBELET_SOCKET, register_all};
use super::sockets::{Slot, ensure_servers, stop_server, update};
use super::wake::{Wake, Wakers};
use super::{DevicePlugin, Error, served};

/// What the serving loop keeps between wake-ups: the servers, and what they last served.
struct State {
    slots: Vec<Slot>,
    kubelet_sock: PathBuf,
    /// Whether every slot was registered at the last tick.
    all_registered: bool,
    /// The resources of the last inventory read (before the overlay and DRA's share).
    last_res: Vec<Resource>,
    /// The devices the CDI spec was last written for.
    last_devices: Vec<(String, u32, Vec<String>)>,
    /// The GPUs the last lists left out (dynamic MIG), so each change is logged once.
    left_out: Vec<resources::LeftOut>,
    /// The served device IDs, for the PodResources poll.
    served_tx: watch::Sender<crate::deviceplugin::both::Served>,
}

/// What the CDI spec depends on: the devices and their nodes, not their health.
fn cdi_identity(inv: &Inventory) -> Vec<(String, u32, Vec<String>)> {
    inv.gpus
        .iter()
        .map(|g| {
            (
                g.uuid.to_string(),
                g.minor,
                g.mig.devices.iter().map(|m| m.uuid.to_string()).collect(),
            )
        })
        .collect()
}

impl DevicePlugin {
    /// Serves until `shutdown`; then stops every server and removes its socket.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), Error> {
        let (inv, lists) = self.read()?;
        let res = lists.resources;
        let mut left_out = Vec::new();
        log_left_out(&mut left_out, lists.left_out);
        let cdi_opts =
            crate::deviceplugin::cdi::options(&self.settings.driver, &self.settings.driver_root)?;
        let ctx = Arc::new(Context::new(self.options.clone(), &cdi_opts));
        let wants_cdi = self.options.list_strategies.iter().any(|s| s.is_cdi());
        if wants_cdi {
            self.write_cdi(&cdi_opts, &inv).await?;
        }
        // GPUs left out (dynamic MIG) come back when DRA turns their MIG mode off: serve on.
        if res.is_empty() && left_out.is_empty() {
            tracing::warn!("device plugin: no devices to advertise; waiting");
            shutdown.cancelled().await;
            return Ok(());
        }
        let served_tx = watch::channel(served(&res)).0;
        let changes = self.both.as_ref().map(|b| b.ledger.changes());
        // Part of this task: should it end, the device plugin ends with it, naming it.
        let pods = self.pod_watch().map(|watch| {
            tokio::spawn(crate::deviceplugin::both::poll_pod_resources(
                watch,
                served_tx.subscribe(),
                shutdown.child_token(),
            ))
        });
        self.log_paths(&res);
        let slots: Vec<Slot> = self
            .unmapped(self.overlaid(res.clone()))
            .into_iter()
            .map(|r| {
                tracing::info!(resource = %r.name, devices = r.devices.len(), "device-plugin resource");
                Slot::new(&self.settings.dir, r)
            })
            .collect();
        let mut st = State {
            slots,
            kubelet_sock: self.settings.dir.join(KUBELET_SOCKET),
            all_registered: false,
            last_res: res,
            last_devices: cdi_identity(&inv),
            left_out,
            served_tx,
        };
        let mut wake = Wakers::new(&self, changes, pods);
        let result = loop {
            match wake.next(&shutdown).await {
                Wake::Shutdown => break Ok(()),
                Wake::Tick => {
                    if let Err(e) = self.on_tick(&mut st, &ctx, &shutdown).await {
                        break Err(e);
                    }
                }
                Wake::Ledger => self.on_ledger_change(&mut st),
                Wake::Classes => {
                    let names: Vec<String> = wake
                        .mapped
                        .as_ref()
                        .map(|m| m.borrow().keys().cloned().collect())
                        .unwrap_or_default();
                    self.on_classes_changed(&mut st, &names).await;
                }
                Wake::PodsEnded(reason) => {
                    break Err(Error::Stopped {
                        task: "pod-resources-poll",
                        reason,
                    });
                }
                Wake::Reread => self.reread(&mut st, &cdi_opts, wants_cdi).await,
            }
        };
        let slots = &mut st.slots;
        for slot in slots {
            stop_server(slot).await;
        }
        tracing::info!("device plugin stopped");
        result
    }

    /// [`Wake::Tick`]: serves again the sockets that are gone or replaced, registers what the
    /// current kubelet has not, and tells [`DevicePlugin::on_registered`] when that changes.
    async fn on_tick(
        &self,
        st: &mut State,
        ctx: &Arc<Context>,
        shutdown: &CancellationToken,
    ) -> Result<(), Error> {
        ensure_servers(&mut st.slots, ctx, self.both.as_ref(), shutdown)?;
        register_all(&mut st.slots, &st.kubelet_sock).await;
        let now = st.slots.iter().all(|s| s.registered.is_some());
        if now != st.all_registered {
            st.all_registered = now;
            if let Some(f) = &self.on_registered {
                f(now);
            }
        }
        Ok(())
    }

    /// [`Wake::Ledger`]: a claim prepared or unprepared: its devices' health changes.
    fn on_ledger_change(&self, st: &mut State) {
        update(
            &mut st.slots,
            &self.settings.dir,
            self.unmapped(self.overlaid(st.last_res.clone())),
        );
    }

    /// [`Wake::Classes`]: DeviceClasses changed: stop serving what DRA now serves (`mapped`, the
    /// resource names they map), serve again what it no longer does.
    async fn on_classes_changed(&self, st: &mut State, mapped: &[String]) {
        self.log_paths(&st.last_res);
        let now = self.unmapped(self.overlaid(st.last_res.clone()));
        let mut kept = Vec::with_capacity(st.slots.len());
        for mut slot in std::mem::take(&mut st.slots) {
            if !mapped.iter().any(|n| n == slot.name.as_str()) {
                kept.push(slot);
            } else {
                tracing::info!(resource = %slot.name, "a DeviceClass maps this resource; the device plugin stops serving it");
                stop_server(&mut slot).await;
            }
        }
        st.slots = kept;
        update(&mut st.slots, &self.settings.dir, now);
    }

    /// [`Wake::Reread`]: reads the inventory again; sends changed device lists, rewrites the CDI
    /// spec when the devices changed, and keeps the last lists when the read fails.
    async fn reread(&self, st: &mut State, cdi_opts: &crate::cdi::CdiOptions, wants_cdi: bool) {
        match self.read() {
            Ok((inv, lists)) => {
                let res = lists.resources;
                log_left_out(&mut st.left_out, lists.left_out);
                let devices = cdi_identity(&inv);
                if wants_cdi
                    && devices != st.last_devices
                    && let Err(e) = self.write_cdi(cdi_opts, &inv).await
                {
                    tracing::warn!(error = %crate::report::chain(&e), "cannot rewrite the device-plugin CDI spec");
                }
                st.last_devices = devices;
                st.served_tx.send_replace(served(&res));
                st.last_res = res.clone();
                update(
                    &mut st.slots,
                    &self.settings.dir,
                    self.unmapped(self.overlaid(res)),
                );
            }
            Err(e) => {
                tracing::warn!(error = %crate::report::chain(&e), "device plugin: keeping the last device lists")
            }
        }
    }
    async fn write_cdi(&self, opts: &crate::cdi::CdiOptions, inv: &Inventory) -> Result<(), Error> {
        let (root, opts, inv, ids) = (
            self.settings.cdi_root.clone(),
            opts.clone(),
            inv.clone(),
            self.options.clone(),
        );
        let path = tokio::task::spawn_blocking(move || {
            crate::deviceplugin::cdi::write_with_modes(&root, &opts, &inv, &ids)
        })
        .await
        .map_err(|e| inventory::Error::Invalid(format!("CDI task failed: {e}")))??;
        tracing::info!(spec = %path.display(), "device-plugin CDI spec written");
        Ok(())
    }
}

/// Logs each GPU that `now` leaves out of the lists and `before` did not (with why), and each
/// that is back, then remembers `now`: once per change, not once per read.
fn log_left_out(before: &mut Vec<resources::LeftOut>, now: Vec<resources::LeftOut>) {
    for l in now.iter().filter(|l| !before.contains(l)) {
        tracing::info!(gpu = l.index, uuid = %l.uuid, why = %l.why,
            "device plugin: leaving the GPU out of its lists");
    }
    for l in before
        .iter()
        .filter(|l| !now.iter().any(|n| n.uuid == l.uuid))
    {
        tracing::info!(gpu = l.index, uuid = %l.uuid, "device plugin: the GPU is back in its lists");
    }
    *before = now;
}
