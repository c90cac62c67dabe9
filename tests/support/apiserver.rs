//! The test Kubernetes API server nvdra's tests and benches run against: the `kubelet-plugin`
//! library's (`kubelet_plugin::testing::ApiServer`, feature `testing`), under the names these
//! tests have always used.
// Each test binary (and bench) uses what it needs.
#![allow(unused_imports)]

pub use kubelet_plugin::testing::{
    ApiCounts as Counts, ApiServer as TestApiServer, RecordedRequest,
};
