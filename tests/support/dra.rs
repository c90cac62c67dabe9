//! Driving `nvdra run` as a process the way the kubelet does, over its unix sockets with nvdra's
//! own tonic client: wait until it serves, prepare and unprepare a claim (`claim-<uid>` in
//! `default`), stop it.
// Each test binary uses what it needs.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use kubelet_plugin::proto::dra::v1;
use kubelet_plugin::proto::pluginregistration::{
    InfoRequest, registration_client::RegistrationClient,
};
use tonic::transport::Channel;

pub async fn unix_channel(path: &Path) -> Result<Channel, tonic::transport::Error> {
    kubelet_plugin::socket::connect(path).await
}

pub async fn wait_ready_at(reg_socket: &Path, child: &mut Child) {
    super::wait::until("nvdra to serve", super::wait::SOON, || {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("nvdra exited before serving: {status}");
        }
        async move {
            let ch = unix_channel(reg_socket).await.ok()?;
            let info = RegistrationClient::new(ch).get_info(InfoRequest {}).await;
            info.ok().map(drop)
        }
    })
    .await
}

/// The kubelet's name for claim `uid` of the tests: `default/claim-<uid>`.
fn claim(uid: &str) -> v1::Claim {
    v1::Claim {
        namespace: "default".into(),
        uid: uid.into(),
        name: format!("claim-{uid}"),
    }
}

async fn client(dra_socket: &Path) -> v1::dra_plugin_client::DraPluginClient<Channel> {
    v1::dra_plugin_client::DraPluginClient::new(unix_channel(dra_socket).await.unwrap())
}

pub async fn prepare_at(
    dra_socket: &Path,
    uid: &str,
) -> Result<v1::NodePrepareResourceResponse, tonic::Status> {
    let mut r = client(dra_socket)
        .await
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![claim(uid)],
        })
        .await?
        .into_inner();
    Ok(r.claims.remove(uid).expect("an entry for the claim"))
}

pub async fn unprepare_at(dra_socket: &Path, uid: &str) -> String {
    unprepare_call(dra_socket, uid).await.unwrap()
}

/// A non-panicking unprepare, for a call the process may die in.
pub async fn unprepare_call(dra_socket: &Path, uid: &str) -> Result<String, tonic::Status> {
    let mut r = client(dra_socket)
        .await
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: vec![claim(uid)],
        })
        .await?
        .into_inner();
    Ok(r.claims.remove(uid).expect("an entry").error)
}

/// Waits for the process to exit without blocking the runtime, which must keep serving the
/// test's client connections while the daemon drains them.
pub async fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    super::wait::until("nvdra to exit", Duration::from_secs(60), || {
        std::future::ready(child.try_wait().unwrap())
    })
    .await
}

pub async fn terminate(child: &mut Child) -> std::process::ExitStatus {
    // SIGTERM through kill(1), so the test needs no unsafe libc call.
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    wait_exit(child).await
}
