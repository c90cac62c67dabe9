//! Fabric registrations in transition: `FAKE_NVML_FABRIC_FILE=<file>` overrides what the node's
//! GPUs report to the fabric-info calls, read again at every call, so a test changes a running
//! process's fabric by rewriting the file (as the fabric manager moves a GPU's registration on).
//!
//! One rule a line (`#` starts a comment; a missing or unreadable file overrides nothing); a
//! later line wins for the GPUs it names:
//!
//! ```text
//! in-progress                          # every GPU: state IN_PROGRESS
//! gpu=2 state=completed status=not-ready
//! gpu=3 call=not-ready                 # the call itself answers NVML_ERROR_NOT_READY
//! ```
//!
//! `state`: `not-supported`, `not-started`, `in-progress`, `completed` (the cluster UUID and
//! clique stay the node's; zero where it has none). `status` (the registration's own result)
//! and `call` (the call's return code): `success`, `not-ready` (NVML_ERROR_NOT_READY, what a
//! driver answers while something is in progress: nvml.h has no `IN_PROGRESS` return code),
//! `in-use`, `gpu-is-lost`, `unknown`, `not-supported`, or a number.

use std::os::raw::c_uint;

use nvml_wrapper_sys::bindings::*;

/// What the file says of one GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Override {
    pub state: Option<c_uint>,
    pub status: Option<nvmlReturn_t>,
    pub call: Option<nvmlReturn_t>,
}

fn state(name: &str) -> Option<c_uint> {
    Some(match name {
        "not-supported" => NVML_GPU_FABRIC_STATE_NOT_SUPPORTED,
        "not-started" => NVML_GPU_FABRIC_STATE_NOT_STARTED,
        "in-progress" => NVML_GPU_FABRIC_STATE_IN_PROGRESS,
        "completed" => NVML_GPU_FABRIC_STATE_COMPLETED,
        _ => return None,
    })
}

fn code(name: &str) -> Option<nvmlReturn_t> {
    Some(match name {
        "success" => nvmlReturn_enum_NVML_SUCCESS,
        "not-ready" => nvmlReturn_enum_NVML_ERROR_NOT_READY,
        "in-use" => nvmlReturn_enum_NVML_ERROR_IN_USE,
        "gpu-is-lost" => nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST,
        "unknown" => nvmlReturn_enum_NVML_ERROR_UNKNOWN,
        "not-supported" => nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED,
        n => return n.parse().ok(),
    })
}

/// The rules of `text` that apply to GPU `index`, merged in order. Words it does not know are
/// ignored (the fake must not fail a call over its own knob).
pub fn parse(text: &str, index: c_uint) -> Override {
    let mut out = Override::default();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("");
        let mut rule = Override::default();
        let mut applies = true;
        for word in line.split_whitespace() {
            match word.split_once('=') {
                None => rule.state = state(word).or(rule.state),
                Some(("gpu", v)) => applies = v.parse::<c_uint>().ok() == Some(index),
                Some(("state", v)) => rule.state = state(v).or(rule.state),
                Some(("status", v)) => rule.status = code(v).or(rule.status),
                Some(("call", v)) => rule.call = code(v).or(rule.call),
                Some(_) => {}
            }
        }
        if applies {
            out.state = rule.state.or(out.state);
            out.status = rule.status.or(out.status);
            out.call = rule.call.or(out.call);
        }
    }
    out
}

/// The override of GPU `index` from `FAKE_NVML_FABRIC_FILE`, read now.
pub fn lookup(index: c_uint) -> Override {
    std::env::var_os("FAKE_NVML_FABRIC_FILE")
        .and_then(|p| std::fs::read_to_string(p).ok())
        .map(|t| parse(&t, index))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_lines_win_for_the_gpus_they_name() {
        let text = "in-progress\ngpu=2 state=completed status=not-ready # done, not ready\n\
                    gpu=3 call=27\nbogus words=here";
        assert_eq!(
            parse(text, 0),
            Override {
                state: Some(NVML_GPU_FABRIC_STATE_IN_PROGRESS),
                ..Default::default()
            }
        );
        assert_eq!(
            parse(text, 2),
            Override {
                state: Some(NVML_GPU_FABRIC_STATE_COMPLETED),
                status: Some(nvmlReturn_enum_NVML_ERROR_NOT_READY),
                call: None,
            }
        );
        assert_eq!(parse(text, 3).call, Some(27));
        assert_eq!(parse("", 0), Override::default());
    }
}
