//! Shared helpers for integration tests.

pub mod apiserver;
pub mod grpcio;
