//! The kubelet-plugin library's integration tests, one module per subject, linked into one test
//! binary: on a 2-core CI machine each file linked as its own binary (each against the library,
//! kube, tonic and k8s-openapi) was a large part of the tests' build. Test names are
//! `module::test` (`cargo test -p kubelet-plugin --test integration serve::`).
//!
//! A new test of the library goes here: a module of its own (`mod subject;` below, the file
//! `tests/integration/subject.rs`), or a test in the module of its subject; not a new file
//! directly under `tests/`, which cargo would link as one more binary. The helpers shared with
//! nvdra's tests (`tests/support/`, which nvdra includes by path) are modules of this crate root:
//! `use crate::{example, require, wait};`.
//!
//! The tests share this process, so none sets an environment variable, changes the working
//! directory, or installs a global tracing subscriber; a test that needs a subscriber sets one
//! for its own thread (see `calls::calls_have_spans_and_failed_claims_are_warnings`).
//! `tests/adopter/` is a crate of its own (a driver's crate, outside the workspace), not a module.

#[path = "../support/example.rs"]
mod example;
#[path = "../support/require.rs"]
mod require;
#[path = "../support/wait.rs"]
mod wait;

mod calls;
mod deploy;
mod example_grpcio;
mod go_lock;
mod metadata;
mod publisher;
mod serve;
