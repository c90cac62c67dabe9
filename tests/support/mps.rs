//! A fake `nvidia-cuda-mps-control` for the tests that run the `nvdra` binary with shares of a
//! GPU (`--shared-capacity`): started with `-d` it logs `start <CUDA_VISIBLE_DEVICES> <pipe dir>`
//! and creates `<pipe dir>/control`, as the real daemon creates its control pipe; given `quit`
//! on stdin it logs `quit <pipe dir>` and removes it. The log, `<driver root>/mps.log`, counts the
//! daemon's starts and stops across restarts of nvdra.
// Each test binary uses what it needs.
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Installs the fake under `<driver_root>/usr/bin`, where nvdra looks for it.
pub fn fake_control(driver_root: &Path) {
    let bin = driver_root.join("usr/bin");
    std::fs::create_dir_all(&bin).unwrap();
    let script = format!(
        "#!/bin/sh\n\
         if [ \"$1\" = -d ]; then\n  \
           echo \"start $CUDA_VISIBLE_DEVICES $CUDA_MPS_PIPE_DIRECTORY\" >> '{log}'\n  \
           : > \"$CUDA_MPS_PIPE_DIRECTORY/control\"\n\
         else\n  \
           while read l; do\n    \
             if [ \"$l\" = get_server_list ]; then [ -e \"$CUDA_MPS_PIPE_DIRECTORY/control\" ] || exit 1; continue; fi\n    \
             echo \"$l $CUDA_MPS_PIPE_DIRECTORY\" >> '{log}'; rm -f \"$CUDA_MPS_PIPE_DIRECTORY/control\"\n  \
           done\n\
         fi\n",
        log = log_path(driver_root).display()
    );
    let p = bin.join("nvidia-cuda-mps-control");
    std::fs::write(&p, script).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
}

pub fn log_path(driver_root: &Path) -> PathBuf {
    driver_root.join("mps.log")
}

/// The fake's log lines, oldest first (none before its first call).
pub fn log(driver_root: &Path) -> Vec<String> {
    std::fs::read_to_string(log_path(driver_root))
        .unwrap_or_default()
        .lines()
        .map(String::from)
        .collect()
}

/// How many lines of the log start with `word` (`start` or `quit`).
pub fn count(driver_root: &Path, word: &str) -> usize {
    log(driver_root)
        .iter()
        .filter(|l| l.split(' ').next() == Some(word))
        .count()
}

/// The pipe directory of the daemon nvdra runs for the shares of GPU `uuid`, under the plugin
/// directory `plugin_dir` (`<kubelet root>/plugins/<driver>`).
pub fn gpu_pipe_dir(plugin_dir: &Path, uuid: &str) -> PathBuf {
    plugin_dir.join(format!("mps/shared-{uuid}/pipe"))
}

/// A share of `device` (`gpu-<minor>-shared`) as the scheduler allocates one: a `shareID` and the
/// consumed capacity.
pub fn share(
    request: &str,
    driver: &str,
    pool: &str,
    device: &str,
    share_id: &str,
    memory: &str,
    compute: &str,
) -> k8s_openapi::api::resource::v1::DeviceRequestAllocationResult {
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    let mut r = nvdra::api::allocated_device(request, driver, pool, device);
    r.share_id = Some(share_id.into());
    r.consumed_capacity = Some(
        [
            ("memory".to_string(), Quantity(memory.into())),
            ("compute".to_string(), Quantity(compute.into())),
        ]
        .into(),
    );
    r
}
