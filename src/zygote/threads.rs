//! Each call's share of the CPUs, for the thread pools of its numeric
//! libraries.
//!
//! The issue this solves: OpenBLAS, MKL, BLIS and OpenMP each run one
//! thread per CPU. Two calls in flight on two CPUs then keep four threads
//! busy, and every one of them waits on the others (measured: a
//! logistic-regression point 89 ms at one thread, 417 ms at two, ~3 s with
//! another call beside it). joblib's workers cap their inner threads at
//! CPUs ÷ n_jobs; so does every call here:
//!
//! 1. Whoever knows how many calls are in flight says so
//!    ([`set_calls_in_flight`]): a sweep its `-j`, a zygote serving links
//!    its calls, a worker one. The count lives in a page shared with the
//!    zygotes forked from this one (a node's own, its lanes), which fork
//!    the calls.
//! 2. A call's environment gets `OMP_NUM_THREADS` and its kin set to
//!    max(1, CPUs ÷ calls in flight), or `--threads-per-call` ([`env_for`]),
//!    for the libraries it loads itself. A variable the call's own `env`
//!    sets is the call's; one set in this process's environment is the
//!    user's, kept as joblib keeps it (unless `--threads-per-call` is given).
//! 3. In the call's child, before node code runs, each pool already loaded
//!    is set to what its variables now say, through its own control, as
//!    threadpoolctl does ([`follow_environment`]): the zygote loaded it long
//!    before the call's environment existed.
//!
//! The zygote never sets a pool to more than one thread: a pool started
//! there does not survive the fork (libgomp's hangs the child). numexpr's,
//! which starts when it is imported, is ended before the zygote's threads
//! are counted ([`forks_safely`]).

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

/// The environment variable of `--threads-per-call`, for the pool drop-in,
/// whose pool size a worker cannot see.
pub const THREADS_PER_CALL_ENV: &str = "FLUKSIO_THREADS_PER_CALL";

/// The variables that size the thread pools of the libraries a call loads
/// itself (joblib's list).
pub const VARIABLES: [&str; 7] = [
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "NUMBA_NUM_THREADS",
];

/// `--threads-per-call`, where given (0: not given). Set once, before any
/// fork; every process forked from this one has it.
static PER_CALL: AtomicUsize = AtomicUsize::new(0);

/// The calls in flight, in a page shared with the zygotes forked from the
/// one that made it; before it is made, one.
static IN_FLIGHT: AtomicPtr<AtomicUsize> = AtomicPtr::new(std::ptr::null_mut());

/// Sets `--threads-per-call` and makes the shared page. Call in the zygote
/// before it forks anything.
pub fn configure(per_call: Option<usize>) {
    PER_CALL.store(per_call.unwrap_or(0), Ordering::Relaxed);
    if !IN_FLIGHT.load(Ordering::Relaxed).is_null() {
        return;
    }
    // SAFETY: a fresh anonymous mapping; no existing memory is touched.
    let page = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            std::mem::size_of::<AtomicUsize>(),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if page == libc::MAP_FAILED {
        return;
    }
    let count = page.cast::<AtomicUsize>();
    // SAFETY: the mapping is page-aligned, zeroed and ours; an AtomicUsize
    // has the layout of a usize.
    unsafe { (*count).store(1, Ordering::Relaxed) };
    IN_FLIGHT.store(count, Ordering::Relaxed);
}

/// In a call's child: the shared page is its zygote's, not the call's to
/// write (a call could set the next calls' share).
pub fn forget_shared_page() {
    let page = IN_FLIGHT.swap(std::ptr::null_mut(), Ordering::Relaxed);
    if !page.is_null() {
        // SAFETY: the page `configure` mapped; nothing in the child reads it
        // again (IN_FLIGHT is null now).
        unsafe { libc::munmap(page.cast(), std::mem::size_of::<AtomicUsize>()) };
    }
}

/// Tells the zygotes sharing the page how many calls are in flight.
pub fn set_calls_in_flight(calls: usize) {
    let page = IN_FLIGHT.load(Ordering::Relaxed);
    if !page.is_null() {
        // SAFETY: a live mapping made by `configure`, never unmapped here.
        unsafe { (*page).store(calls.max(1), Ordering::Relaxed) };
    }
}

/// The calls in flight, as whoever knows says ([`set_calls_in_flight`]).
pub fn calls_in_flight() -> usize {
    let page = IN_FLIGHT.load(Ordering::Relaxed);
    if page.is_null() {
        return 1;
    }
    // SAFETY: as in `set_calls_in_flight`.
    unsafe { (*page).load(Ordering::Relaxed) }.max(1)
}

/// The CPUs this process may run on (its affinity and its cgroup's quota),
/// and under SLURM no more than its task was given: a cluster that does
/// not pin tasks to their CPUs leaves the whole node in reach.
pub fn cpus() -> usize {
    static CPUS: OnceLock<usize> = OnceLock::new();
    *CPUS.get_or_init(|| {
        let reachable = std::thread::available_parallelism().map_or(1, |n| n.get());
        let given = ["SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"]
            .iter()
            .find_map(|name| std::env::var(name).ok()?.trim().parse::<usize>().ok())
            .filter(|&given| given > 0);
        given.map_or(reachable, |given| given.min(reachable))
    })
}

/// Threads one call gets: `--threads-per-call`, else its share of the CPUs.
pub fn per_call() -> usize {
    match PER_CALL.load(Ordering::Relaxed) {
        0 => share(cpus(), calls_in_flight()),
        given => given,
    }
}

/// max(1, cpus ÷ calls).
pub fn share(cpus: usize, calls: usize) -> usize {
    (cpus / calls.max(1)).max(1)
}

/// The thread variables to add to a call whose own `env` is `call_env`:
/// each one neither that env nor (without `--threads-per-call`) this
/// process's environment sets.
pub fn env_for(call_env: &[(String, String)]) -> Vec<(String, String)> {
    let given = PER_CALL.load(Ordering::Relaxed) != 0;
    let threads = per_call().to_string();
    VARIABLES
        .iter()
        .filter(|name| !call_env.iter().any(|(key, _)| key == *name))
        .filter(|name| given || std::env::var_os(name).is_none())
        .map(|name| (name.to_string(), threads.clone()))
        .collect()
}

/// A numeric library's thread pool, loaded in this process.
#[derive(Clone)]
struct Pool {
    kind: Kind,
    /// The library's handle (`dlopen` of a loaded library, never closed).
    handle: *mut c_void,
    set: Setter,
    /// OpenBLAS only: its `blas_cpu_number` and `blas_num_threads` (see
    /// [`Pool::set_threads`]).
    openblas: Option<(*mut c_int, *const c_int)>,
}

// SAFETY: raw addresses in loaded libraries, used on the one thread that
// calls into them.
unsafe impl Send for Pool {}
unsafe impl Sync for Pool {}

/// A pool's setter, by the width of its argument.
#[derive(Clone, Copy)]
enum Setter {
    Int(unsafe extern "C" fn(c_int)),
    Wide(unsafe extern "C" fn(i64)),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    OpenBlas,
    Mkl,
    Blis,
    FlexiBlas,
    OpenMp,
    /// numexpr's virtual machine, which starts its pool when it is
    /// imported (pandas imports it where it is installed).
    NumExpr,
}

impl Kind {
    /// The kind of the library at `path`: numexpr's extension module by
    /// its package, the rest by their file names.
    fn of_path(path: &[u8]) -> Option<Kind> {
        let mut parts = path.rsplit(|&b| b == b'/');
        let name = String::from_utf8_lossy(parts.next()?);
        if name.starts_with("interpreter.") && parts.next() == Some(b"numexpr") {
            return Some(Kind::NumExpr);
        }
        Kind::of(&name)
    }

    /// What a library's file name starts with (threadpoolctl's prefixes).
    fn of(file_name: &str) -> Option<Kind> {
        let prefixes: [(&str, Kind); 8] = [
            ("libopenblas", Kind::OpenBlas),
            ("libscipy_openblas", Kind::OpenBlas),
            ("libmkl_rt", Kind::Mkl),
            ("libblis", Kind::Blis),
            ("libflexiblas", Kind::FlexiBlas),
            ("libgomp", Kind::OpenMp),
            ("libiomp", Kind::OpenMp),
            ("libomp", Kind::OpenMp),
        ];
        prefixes
            .iter()
            .find(|(prefix, _)| file_name.starts_with(prefix))
            .map(|&(_, kind)| kind)
    }

    /// The variables a library of this kind reads for its size, first
    /// match wins, as each library itself reads them.
    fn variables(self) -> &'static [&'static str] {
        match self {
            Kind::OpenBlas => &[
                "OPENBLAS_NUM_THREADS",
                "GOTO_NUM_THREADS",
                "OMP_NUM_THREADS",
            ],
            Kind::Mkl => &["MKL_NUM_THREADS", "OMP_NUM_THREADS"],
            Kind::Blis => &["BLIS_NUM_THREADS", "OMP_NUM_THREADS"],
            Kind::FlexiBlas => &["FLEXIBLAS_NUM_THREADS", "OMP_NUM_THREADS"],
            Kind::OpenMp => &["OMP_NUM_THREADS"],
            Kind::NumExpr => &["NUMEXPR_NUM_THREADS", "OMP_NUM_THREADS"],
        }
    }

    /// Its setter's possible names: OpenBLAS builds may prefix `scipy_`
    /// and suffix `64_` or `_64` (threadpoolctl tries the same).
    fn setters(self) -> Vec<String> {
        match self {
            Kind::OpenBlas => ["", "scipy_"]
                .iter()
                .flat_map(|prefix| {
                    ["", "64_", "_64"]
                        .iter()
                        .map(move |suffix| format!("{prefix}openblas_set_num_threads{suffix}"))
                })
                .collect(),
            Kind::Mkl => vec!["MKL_Set_Num_Threads".into()],
            Kind::Blis => vec!["bli_thread_set_num_threads".into()],
            Kind::FlexiBlas => vec!["flexiblas_set_num_threads".into()],
            Kind::OpenMp => vec!["omp_set_num_threads".into()],
            // `int numexpr_set_nthreads(int)`, a C++ name: it joins the
            // pool's threads, then starts as many as asked past one.
            Kind::NumExpr => vec!["_Z20numexpr_set_nthreadsi".into()],
        }
    }

    /// Threads the variables of `read` ask of this kind; `None` where none
    /// is set or none is a number (`OMP_NUM_THREADS=4,2` asks 4: its outer
    /// level).
    fn wanted(self, read: impl Fn(&str) -> Option<String>) -> Option<usize> {
        let value = self.variables().iter().find_map(|name| read(name))?;
        let first = value.split(',').next()?.trim();
        first.parse::<usize>().ok().filter(|&n| n > 0)
    }
}

impl Pool {
    fn set_threads(&self, threads: usize) {
        let threads = c_int::try_from(threads).unwrap_or(c_int::MAX);
        if let Some((cpu_number, pool_size)) = self.openblas {
            // OpenBLAS's setter restarts its pool first, after a fork: one
            // thread per CPU started in every call's child, even to run on
            // one. Within the pool's size the count it runs on is this one
            // variable, which its calls read; past it, the setter grows the
            // pool.
            // SAFETY: both are the library's own `int` globals, found by
            // dlsym in this process; one thread.
            unsafe {
                if threads <= *pool_size {
                    *cpu_number = threads;
                    return;
                }
            }
        }
        // SAFETY: a setter of this signature, found by name in a loaded
        // library, called on the thread that will run node code.
        unsafe {
            match self.set {
                Setter::Int(set) => set(threads),
                Setter::Wide(set) => set(i64::from(threads)),
            }
        }
    }
}

/// Each loaded library of a known kind, with its handle (`dlopen` of a
/// loaded library, never closed).
fn loaded_of_known_kinds() -> impl Iterator<Item = (Kind, *mut c_void)> {
    loaded_libraries().into_iter().filter_map(|path| {
        let kind = Kind::of_path(path.to_bytes())?;
        // SAFETY: RTLD_NOLOAD only finds a library already loaded; it loads
        // and runs nothing.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        (!handle.is_null()).then_some((kind, handle))
    })
}

/// The thread pools loaded in this process: each library of a known kind,
/// with its setter.
fn loaded_pools() -> Vec<Pool> {
    let mut pools = Vec::new();
    for (kind, handle) in loaded_of_known_kinds() {
        let Some(set) = kind.setters().iter().find_map(|name| symbol(handle, name)) else {
            continue;
        };
        let set = if kind == Kind::Blis {
            // SAFETY: BLIS's setter is `void f(dim_t)`, a 64-bit integer.
            Setter::Wide(unsafe {
                std::mem::transmute::<*mut c_void, unsafe extern "C" fn(i64)>(set)
            })
        } else {
            // SAFETY: every other setter here is `void f(int)`.
            Setter::Int(unsafe {
                std::mem::transmute::<*mut c_void, unsafe extern "C" fn(c_int)>(set)
            })
        };
        let openblas = (kind == Kind::OpenBlas)
            .then(|| {
                let cpu_number = symbol(handle, "blas_cpu_number")?;
                let pool_size = symbol(handle, "blas_num_threads")?;
                Some((
                    cpu_number.cast::<c_int>(),
                    pool_size.cast::<c_int>().cast_const(),
                ))
            })
            .flatten();
        pools.push(Pool {
            kind,
            handle,
            set,
            openblas,
        });
    }
    pools
}

fn symbol(handle: *mut c_void, name: &str) -> Option<*mut c_void> {
    let name = CString::new(name).ok()?;
    // SAFETY: a handle from dlopen and a NUL-terminated name.
    let address = unsafe { libc::dlsym(handle, name.as_ptr()) };
    (!address.is_null()).then_some(address)
}

/// How many shared objects are loaded in this process.
fn loaded_count() -> usize {
    unsafe extern "C" fn each(
        _info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: `data` is the counter handed to dl_iterate_phdr below.
        unsafe { *data.cast::<usize>() += 1 };
        0
    }
    let mut count: usize = 0;
    // SAFETY: the callback only increments `count`, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(each), (&mut count as *mut usize).cast()) };
    count
}

/// The paths of the shared objects loaded in this process (the main
/// program and the vDSO, which have no path, left out).
fn loaded_libraries() -> Vec<CString> {
    unsafe extern "C" fn each(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: dl_iterate_phdr passes a valid info, and `data` is the
        // Vec handed to it below, alive for the whole iteration.
        unsafe {
            let paths = &mut *data.cast::<Vec<CString>>();
            let name: *const c_char = (*info).dlpi_name;
            if !name.is_null() {
                let name = CStr::from_ptr(name);
                if !name.is_empty() {
                    paths.push(name.to_owned());
                }
            }
        }
        0
    }
    let mut paths: Vec<CString> = Vec::new();
    // SAFETY: the callback only pushes to `paths`, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(each), (&mut paths as *mut Vec<CString>).cast()) };
    paths
}

/// The pools the zygote found before it forked, and how many shared
/// objects were loaded then. Found in the zygote, not in each child: the
/// search (`dlopen` of each library) writes to the loader's tables, about
/// 150 copy-on-write faults in every child that did it.
static FOUND: std::sync::Mutex<Option<(usize, Vec<Pool>)>> = std::sync::Mutex::new(None);

/// In the zygote, before a fork: finds the loaded pools, again only where
/// libraries were loaded since.
pub fn find_pools() {
    let count = loaded_count();
    let mut found = FOUND.lock().unwrap_or_else(|e| e.into_inner());
    if found.as_ref().is_none_or(|(seen, _)| *seen != count) {
        *found = Some((count, loaded_pools()));
    }
}

/// In a call's child, once the call's environment is in place and before
/// node code runs: every loaded pool sized as its variables now say.
/// `again`: look for pools loaded since the fork (a resident's earlier
/// calls, a node loaded in the child). Nothing to do where the environment
/// did not `change` and no pool was loaded since.
pub fn follow_environment(changed: bool, again: bool) {
    if again {
        let before = FOUND
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|f| f.0);
        find_pools();
        let after = FOUND
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|f| f.0);
        if !changed && before == after {
            return;
        }
    } else if !changed {
        return;
    }
    size_pools(|_, _| true);
}

/// In a reset resident, for a call that finds its variables set already:
/// the pools that start their threads when they are sized (numexpr's),
/// which the snapshot holds at one thread (`end_pools`), sized as those
/// variables say, as a fresh child's are.
pub fn resize_eager_pools() {
    size_pools(|kind, threads| kind == Kind::NumExpr && threads > 1);
}

/// Each pool found that `which` picks (by its kind and the threads its
/// variables ask for) sized as its variables now say.
fn size_pools(which: impl Fn(Kind, usize) -> bool) {
    let read = |name: &str| std::env::var(name).ok();
    let found = FOUND.lock().unwrap_or_else(|e| e.into_inner());
    let Some((_, pools)) = found.as_ref() else {
        return;
    };
    for pool in pools {
        if let Some(threads) = pool.kind.wanted(read).filter(|&n| which(pool.kind, n)) {
            pool.set_threads(threads);
        }
    }
}

/// Runs `f` with the loaded OpenMP, MKL and OpenBLAS pools at one thread,
/// then puts back what they were asked before: for node code run in the
/// zygote itself (a warm-up), where an OpenMP pool that starts its threads
/// would hang every child forked after it. (OpenBLAS stops its own pool at
/// fork, but is kept from waking it here all the same.)
pub fn single_threaded<R>(f: impl FnOnce() -> R) -> R {
    find_pools();
    let found = FOUND.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let pools: Vec<Pool> = found
        .map(|(_, pools)| pools)
        .unwrap_or_default()
        .into_iter()
        .filter(|pool| match pool.kind {
            Kind::OpenMp | Kind::Mkl | Kind::NumExpr => true,
            // Only where its count can be set without its setter, which
            // would start its pool here.
            Kind::OpenBlas => pool.openblas.is_some(),
            Kind::Blis | Kind::FlexiBlas => false,
        })
        .collect();
    let before: Vec<Option<usize>> = pools.iter().map(Pool::asked).collect();
    for pool in &pools {
        pool.set_threads(1);
    }
    let result = f();
    for (pool, before) in pools.iter().zip(before) {
        if let Some(threads) = before {
            pool.set_threads(threads);
        }
    }
    result
}

/// Whether this process can fork with no stray thread, once the pools
/// that start their threads on their own have ended them (numexpr's, when
/// it is imported: a preload, a node, a learned import, a warm-up). Every
/// check of the zygote's threads goes through here.
pub fn forks_safely(py: pyo3::Python<'_>) -> bool {
    end_pools();
    fluksio_embed::fork::forks_safely(py)
}

/// Ends the threads a call's pools started, as each library ends them
/// itself: OpenBLAS's server as it does before a fork
/// (`blas_thread_shutdown_`), an OpenMP runtime's team by
/// `omp_pause_resource_all(omp_pause_hard)` (libgomp, LLVM's and Intel's
/// runtimes; MKL's threads are the latter's), numexpr's by setting it to
/// one thread, which joins the rest. For a reset resident, whose
/// memory is put back only where it runs one thread again: a pool asked
/// for more than one thread per call starts its threads in every call.
/// Libraries the call loaded itself are looked for too: their threads run
/// code the put-back unmaps. Returns whether any pool was asked to end.
pub fn end_pools() -> bool {
    const OMP_PAUSE_HARD: c_int = 2;
    let mut asked = false;
    for (kind, handle) in loaded_of_known_kinds() {
        let ender = match kind {
            Kind::OpenBlas => "blas_thread_shutdown_",
            Kind::OpenMp => "omp_pause_resource_all",
            Kind::NumExpr => "_Z20numexpr_set_nthreadsi",
            Kind::Mkl | Kind::Blis | Kind::FlexiBlas => continue,
        };
        if let Some(end) = symbol(handle, ender) {
            asked = true;
            // SAFETY: each by its signature, found by name in a loaded
            // library, called on the thread that ran the call (the one an
            // OpenMP team belongs to).
            unsafe {
                if kind == Kind::OpenBlas {
                    let end: unsafe extern "C" fn() -> c_int = std::mem::transmute(end);
                    end();
                } else if kind == Kind::NumExpr {
                    // One thread: its pool joined, none started.
                    let end: unsafe extern "C" fn(c_int) -> c_int = std::mem::transmute(end);
                    end(1);
                } else {
                    // `omp_pause_resource_t` is a C enum: an int.
                    let end: unsafe extern "C" fn(c_int) -> c_int = std::mem::transmute(end);
                    end(OMP_PAUSE_HARD);
                }
            }
        }
    }
    asked
}

impl Pool {
    /// What an OpenMP, MKL or OpenBLAS pool is asked to run on now.
    fn asked(&self) -> Option<usize> {
        let name = match self.kind {
            Kind::OpenMp => "omp_get_max_threads",
            Kind::Mkl => "MKL_Get_Max_Threads",
            Kind::OpenBlas => {
                let (cpu_number, _) = self.openblas?;
                // SAFETY: the library's own `int`, found by dlsym; one thread.
                return usize::try_from(unsafe { *cpu_number })
                    .ok()
                    .filter(|&n| n > 0);
            }
            Kind::Blis | Kind::FlexiBlas | Kind::NumExpr => return None,
        };
        let get = symbol(self.handle, name)?;
        // SAFETY: both getters are `int f(void)`.
        let get: unsafe extern "C" fn() -> c_int = unsafe { std::mem::transmute(get) };
        // SAFETY: a getter of that signature in a loaded library.
        usize::try_from(unsafe { get() }).ok().filter(|&n| n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_gets_its_share_of_the_cpus_and_at_least_one() {
        assert_eq!(share(8, 4), 2);
        assert_eq!(share(2, 2), 1);
        assert_eq!(share(2, 1), 2);
        assert_eq!(share(2, 5), 1);
        assert_eq!(share(3, 2), 1);
        assert_eq!(share(4, 0), 4);
    }

    #[test]
    fn each_library_reads_its_own_variable_first() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let both = env(&[("OMP_NUM_THREADS", "4,2"), ("OPENBLAS_NUM_THREADS", "1")]);
        assert_eq!(Kind::OpenBlas.wanted(both), Some(1));
        assert_eq!(Kind::OpenMp.wanted(both), Some(4));
        assert_eq!(Kind::Mkl.wanted(both), Some(4));
        assert_eq!(Kind::Blis.wanted(env(&[])), None);
        assert_eq!(
            Kind::OpenMp.wanted(env(&[("OMP_NUM_THREADS", "many")])),
            None
        );
        assert_eq!(Kind::OpenMp.wanted(env(&[("OMP_NUM_THREADS", "0")])), None);
    }

    #[test]
    fn libraries_are_known_by_their_file_names() {
        assert_eq!(
            Kind::of("libscipy_openblas64_-32a4b2a6.so"),
            Some(Kind::OpenBlas)
        );
        assert_eq!(Kind::of("libgomp-e985bcbb.so.1.0.0"), Some(Kind::OpenMp));
        assert_eq!(Kind::of("libmkl_rt.so.2"), Some(Kind::Mkl));
        assert_eq!(Kind::of("libpython3.11.so.1.0"), None);
        assert_eq!(
            Kind::of_path(b"/v/site-packages/numexpr/interpreter.cpython-311-x86_64-linux-gnu.so"),
            Some(Kind::NumExpr)
        );
        assert_eq!(
            Kind::of_path(b"/v/lib-dynload/interpreter.cpython-311-x86_64-linux-gnu.so"),
            None
        );
        assert_eq!(
            Kind::of_path(b"/v/numpy.libs/libscipy_openblas64_-32a4b2a6.so"),
            Some(Kind::OpenBlas)
        );
        assert!(
            Kind::OpenBlas
                .setters()
                .contains(&"scipy_openblas_set_num_threads64_".to_string())
        );
    }
}
