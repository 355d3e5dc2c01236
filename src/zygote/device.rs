//! GPUs, without ever initialising CUDA in a zygote.
//!
//! A CUDA context does not survive a fork: a child of a process that made
//! one cannot use the GPU. So a zygote must never make one, and:
//! - torch's `cuda.is_available()` is answered from NVML in it
//!   (`PYTORCH_NVML_BASED_CUDA_CHECK`), which makes no context, so a node
//!   that asks at module level leaves its zygote forkable;
//! - a node whose load does make one (a `.cuda()`, a CuPy array) is found
//!   by its trial ([`cuda_in_use`]) and kept out of the zygote;
//! - a GPU slot is a lane (a fork of the zygote) that sets
//!   `CUDA_VISIBLE_DEVICES` to its one GPU before it forks any child, and
//!   whose standby children may each make their context ahead of their
//!   call (`--cuda-warm`): the child is a leaf, and the context is then
//!   the call's own.

use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::prelude::*;

/// torch reads it at each `cuda.is_available()`.
const NVML_CHECK: &str = "PYTORCH_NVML_BASED_CUDA_CHECK";

/// Where the NVIDIA driver lists the GPUs it drives, one entry each.
const DRIVER_GPUS: &str = "/proc/driver/nvidia/gpus";

/// One GPU slot's device, as `CUDA_VISIBLE_DEVICES` names it (an index
/// or a `GPU-…` UUID), and whether its standbys make a context ahead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    pub id: String,
    pub warm: bool,
}

/// In this process, its standbys make a CUDA context ahead of their call.
static WARM: AtomicBool = AtomicBool::new(false);

/// Before any Python runs: torch's availability check asks NVML, unless
/// the user chose otherwise.
pub fn answer_availability_from_nvml() {
    if std::env::var_os(NVML_CHECK).is_none() {
        // SAFETY: called at start-up, before this process has a second
        // thread.
        unsafe { std::env::set_var(NVML_CHECK, "1") };
    }
}

/// `--gpus all`: `CUDA_VISIBLE_DEVICES`'s entries where it is set (the
/// GPUs this job was given), else one index per GPU the driver drives.
pub fn all_gpus() -> Result<Vec<String>, String> {
    if let Ok(visible) = std::env::var("CUDA_VISIBLE_DEVICES") {
        let ids = parse_list(&visible);
        if ids.is_empty() {
            return Err(format!(
                "--gpus all: CUDA_VISIBLE_DEVICES={visible:?} names no GPU"
            ));
        }
        return Ok(ids);
    }
    let count = std::fs::read_dir(DRIVER_GPUS)
        .map(|entries| entries.count())
        .unwrap_or(0);
    if count == 0 {
        return Err(format!(
            "--gpus all: no GPU here (the NVIDIA driver lists none in {DRIVER_GPUS}, and \
             CUDA_VISIBLE_DEVICES is not set)\nhint: give the devices, e.g. --gpus 0,1"
        ));
    }
    Ok((0..count).map(|i| i.to_string()).collect())
}

/// `--gpus 0,1,3`: the ids, in order, each once.
pub fn parse_list(text: &str) -> Vec<String> {
    let mut ids: Vec<String> = Vec::new();
    for id in text.split(',').map(str::trim).filter(|id| !id.is_empty()) {
        if !ids.iter().any(|seen| seen == id) {
            ids.push(id.to_string());
        }
    }
    ids
}

/// Whether an NVIDIA driver is loaded here (what `--cuda-warm` needs).
pub fn driver_loaded() -> bool {
    std::path::Path::new("/proc/driver/nvidia/version").exists()
}

/// In a lane just forked: its children see `gpu` alone, and with
/// `gpu.warm` each standby makes its context ahead of its call.
pub fn take(py: Python<'_>, gpu: &Gpu) -> PyResult<()> {
    // Through os.environ, which sets the C environment too: torch, CuPy and
    // the CUDA runtime read it there, Python code in os.environ.
    let environ = py.import("os")?.getattr("environ")?;
    environ.set_item("CUDA_VISIBLE_DEVICES", &gpu.id)?;
    WARM.store(gpu.warm, Ordering::Relaxed);
    Ok(())
}

/// In a standby child of a warm GPU slot, before it waits for its call:
/// its CUDA context, made now. With torch loaded, through torch (its
/// runtime and allocator set up too); else through the driver API, whose
/// primary context is the one every CUDA runtime then uses. A failure
/// leaves the call to make its own context, as without `--cuda-warm`.
pub(super) fn warm_standby(py: Python<'_>) {
    if !WARM.load(Ordering::Relaxed) {
        return;
    }
    let warmed = py.run(
        c"
import sys, ctypes
torch = sys.modules.get('torch')
if torch is not None:
    torch.empty(1, device='cuda')
else:
    cuda = ctypes.CDLL('libcuda.so.1')
    device, context = ctypes.c_int(), ctypes.c_void_p()
    assert cuda.cuInit(0) == 0
    assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
    assert cuda.cuCtxSetCurrent(context) == 0
",
        None,
        None,
    );
    if let Err(error) = warmed {
        tracing::debug!("--cuda-warm: no context made ahead: {error}");
    }
}

/// Whether this process holds a CUDA context, or the driver open for one:
/// torch says it initialised CUDA, or an fd or a mapping is one of the
/// driver's devices (any library: CuPy, JAX, TensorFlow, the runtime).
pub fn cuda_in_use(py: Python<'_>) -> bool {
    let torch_initialised = py
        .import("sys")
        .and_then(|sys| sys.getattr("modules")?.get_item("torch"))
        .and_then(|torch| torch.getattr("cuda")?.call_method0("is_initialized"))
        .and_then(|initialised| initialised.extract::<bool>())
        .unwrap_or(false);
    torch_initialised || holds_driver_device()
}

/// A driver device (`/dev/nvidia*`) open or mapped in this process.
fn holds_driver_device() -> bool {
    let is_device = |path: &str| path.starts_with("/dev/nvidia");
    let open = std::fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .flatten()
        .any(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|target| is_device(&target.to_string_lossy()))
        });
    open || std::fs::read_to_string("/proc/self/maps").is_ok_and(|maps| {
        maps.lines()
            .filter_map(|line| line.split_whitespace().nth(5))
            .any(is_device)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_keeps_its_order_and_each_id_once() {
        assert_eq!(parse_list("2, 0,2,,GPU-ab"), ["2", "0", "GPU-ab"]);
        assert!(parse_list(" , ").is_empty());
    }
}
