//! RFC 1123 names as Kubernetes checks them: the one validator for DNS labels and subdomains
//! (object names, driver names, pool and device names, label-key prefixes), which is the
//! kubelet-plugin library's, as its ResourceSlice rules use it.

pub use kubelet_plugin::validate::{is_dns_label as is_label, is_dns_subdomain as is_subdomain};
