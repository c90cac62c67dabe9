//! The `v1beta1.DevicePlugin` gRPC service of one resource: `ListAndWatch` re-sends the whole
//! list on every change of the resource's devices; `GetPreferredAllocation` and `Allocate` answer
//! from the same list; in `--mode both`, Allocate refuses a device a DRA claim holds and holds
//! the devices it hands out, atomically with the ledger's claims ([`super::both`]).

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use kubelet_plugin::proto::deviceplugin::v1beta1 as pb;
use kubelet_plugin::proto::deviceplugin::v1beta1::device_plugin_server::DevicePlugin as DevicePluginApi;

use super::allocate::{self, Context};
use super::both::Both;
use super::preferred;
use super::resources::Resource;
use super::{ResourceName, wire};

/// The gRPC service of one resource.
#[derive(Clone)]
pub(super) struct Service {
    pub(super) name: ResourceName,
    pub(super) devices: watch::Receiver<Arc<Resource>>,
    pub(super) ctx: Arc<Context>,
    pub(super) both: Option<Both>,
    pub(super) shutdown: CancellationToken,
}

type ListStream = Pin<Box<dyn Stream<Item = Result<pb::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePluginApi for Service {
    async fn get_device_plugin_options(
        &self,
        request: Request<pb::Empty>,
    ) -> Result<Response<pb::DevicePluginOptions>, Status> {
        let pb::Empty {} = request.into_inner();
        Ok(Response::new(wire::plugin_options()))
    }

    type ListAndWatchStream = ListStream;

    async fn list_and_watch(
        &self,
        request: Request<pb::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let pb::Empty {} = request.into_inner();
        tracing::debug!(resource = %self.name, "ListAndWatch opened");
        let (tx, rx) = mpsc::channel(1);
        let mut devices = self.devices.clone();
        let token = self.shutdown.clone();
        tokio::spawn(async move {
            loop {
                let msg = wire::list_response(&devices.borrow_and_update());
                if tx.send(Ok(msg)).await.is_err() {
                    break;
                }
                tokio::select! {
                    biased;
                    () = token.cancelled() => break,
                    () = tx.closed() => break,
                    changed = devices.changed() => if changed.is_err() { break },
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<pb::PreferredAllocationRequest>,
    ) -> Result<Response<pb::PreferredAllocationResponse>, Status> {
        let requests = wire::preferred_requests(request.into_inner());
        let resource = self.devices.borrow().clone();
        let answers = requests
            .iter()
            .map(|r| preferred::preferred(&resource, r, self.ctx.options.packed))
            .collect();
        Ok(Response::new(wire::preferred_response(answers)))
    }

    async fn allocate(
        &self,
        request: Request<pb::AllocateRequest>,
    ) -> Result<Response<pb::AllocateResponse>, Status> {
        let containers = wire::allocate_requests(request.into_inner());
        let resource = self.devices.borrow().clone();
        // What each container gets; the first refusal stops the request.
        let allocated: Result<Vec<_>, allocate::Error> = containers
            .iter()
            .map(|ids| allocate::allocate(&resource, ids, &self.ctx))
            .collect();
        let allocated = match &self.both {
            // The claims are checked once, atomically with holding the devices (every
            // container's, or none): a device a claim holds is refused naming the claim, not as
            // merely unhealthy, and only an Allocate that succeeds holds anything.
            Some(both) => {
                match super::both::hold(both, &resource, &containers.concat(), allocated) {
                    Ok(allocated) => allocated,
                    Err(e) => {
                        tracing::warn!(resource = %self.name, error = %e, "Allocate refused");
                        return Err(Status::failed_precondition(e.to_string()));
                    }
                }
            }
            None => allocated,
        };
        let allocated = allocated.map_err(|e| {
            tracing::warn!(resource = %self.name, error = %e, "Allocate refused");
            Status::invalid_argument(e.to_string())
        })?;
        if let Some(both) = &self.both {
            // Held; PodResources names the pod soon.
            both.poke.notify_one();
        }
        let container_responses: Vec<_> = allocated
            .into_iter()
            .map(wire::container_response)
            .collect();
        tracing::debug!(resource = %self.name, containers = container_responses.len(), "Allocate");
        Ok(Response::new(pb::AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        request: Request<pb::PreStartContainerRequest>,
    ) -> Result<Response<pb::PreStartContainerResponse>, Status> {
        let pb::PreStartContainerRequest { devices_ids: _ } = request.into_inner();
        Ok(Response::new(pb::PreStartContainerResponse {}))
    }
}
