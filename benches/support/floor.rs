//! The C fork floor: `fork` + `_exit` + `waitpid` of a process holding a
//! given amount of touched anonymous memory in 4 KiB pages.
//!
//! What any fork-per-call design pays at that memory before it runs a line:
//! the kernel copies the page tables at fork and tears them down at exit.
//! 4 KiB pages (`MADV_NOHUGEPAGE`) because pymalloc's arenas are too small
//! for huge pages, so a Python zygote's heap is 4 KiB pages too.
//!
//! It must fork from a single-threaded process, as the zygote does: the
//! comparison bench runs it in a child of its own (its binary again, with
//! the hidden `--floor-kib`), one or several at once; `benches/worker.rs`
//! calls [`cycles`] from its own single-threaded main.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

/// Touched anonymous memory, unmapped on drop.
struct Touched {
    memory: *mut libc::c_void,
    bytes: usize,
}

impl Touched {
    fn new(kib: usize) -> Touched {
        let bytes = kib.max(4) * 1024;
        // SAFETY: a fresh private anonymous mapping of `bytes`, written only
        // within its bounds; checked against MAP_FAILED before use.
        unsafe {
            let memory = libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(memory, libc::MAP_FAILED, "mmap of {bytes} bytes");
            libc::madvise(memory, bytes, libc::MADV_NOHUGEPAGE);
            std::ptr::write_bytes(memory.cast::<u8>(), 1, bytes);
            Touched { memory, bytes }
        }
    }
}

impl Drop for Touched {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe {
            libc::munmap(self.memory, self.bytes);
        }
    }
}

/// One cycle: fork, the child `_exit`s at once, the parent reaps it.
fn cycle() -> Duration {
    let start = Instant::now();
    // SAFETY: the caller is single-threaded (see the module doc); the child
    // calls only the async-signal-safe `_exit`.
    unsafe {
        let pid = libc::fork();
        if pid == 0 {
            libc::_exit(0);
        }
        assert!(pid > 0, "fork failed");
        let mut status = 0;
        libc::waitpid(pid, &mut status, 0);
    }
    start.elapsed()
}

/// `calls` fork cycles of this process holding `anon_kib` of touched
/// anonymous memory. Call it from a single-threaded process only.
pub fn cycles(anon_kib: usize, calls: usize) -> Vec<Duration> {
    let memory = Touched::new(anon_kib);
    let samples = (0..calls).map(|_| cycle()).collect();
    drop(memory);
    samples
}

/// `--floor-kib K --floor-calls N`: touches the memory, prints
/// `ready`, waits for a line on stdin (so several floor processes start
/// together), runs the cycles, prints each in nanoseconds and then
/// `elapsed NS` for the whole loop.
pub fn child_main(anon_kib: usize, calls: usize) -> ExitCode {
    let memory = Touched::new(anon_kib);
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "ready");
    let _ = stdout.flush();
    let mut go = String::new();
    let _ = std::io::stdin().read_line(&mut go);
    let (own, children) = (rusage(libc::RUSAGE_SELF), rusage(libc::RUSAGE_CHILDREN));
    let started = Instant::now();
    let samples: Vec<Duration> = (0..calls).map(|_| cycle()).collect();
    let elapsed = started.elapsed();
    let (own_after, children_after) = (rusage(libc::RUSAGE_SELF), rusage(libc::RUSAGE_CHILDREN));
    drop(memory);
    for sample in &samples {
        let _ = writeln!(stdout, "{}", sample.as_nanos());
    }
    let _ = writeln!(
        stdout,
        "usage {} {} {} {}",
        own_after.0.saturating_sub(own.0),
        own_after.1.saturating_sub(own.1),
        children_after.0.saturating_sub(children.0),
        children_after.1.saturating_sub(children.1)
    );
    let _ = writeln!(stdout, "elapsed {}", elapsed.as_nanos());
    ExitCode::SUCCESS
}

/// (CPU µs, minor faults) of `who`.
pub fn rusage(who: libc::c_int) -> (u64, u64) {
    // SAFETY: getrusage fills the zeroed struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut usage);
        usage
    };
    let micros = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    (
        micros(usage.ru_utime) + micros(usage.ru_stime),
        usage.ru_minflt as u64,
    )
}

/// What floor processes measured together.
pub struct FloorRun {
    /// Every cycle of every process.
    pub samples: Vec<Duration>,
    /// Cycles per second of all processes together.
    pub rate: f64,
    /// CPU and faults per cycle, in the forking process and in its children.
    pub profile: String,
}

/// Runs `processes` floor processes at once (`exe --floor-kib …`, `exe`
/// being a binary whose [`child_main`] that flag reaches), `calls` cycles
/// in all, and gathers what they measured.
pub fn run(
    exe: &Path,
    anon_kib: usize,
    calls: usize,
    processes: usize,
) -> Result<FloorRun, String> {
    let processes = processes.max(1);
    let per = calls.div_ceil(processes).max(1);
    let mut children = Vec::new();
    for _ in 0..processes {
        let mut child = Command::new(exe)
            .args(["--floor-kib", &anon_kib.to_string()])
            .args(["--floor-calls", &per.to_string()])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start the floor process: {e}"))?;
        let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
        let mut line = String::new();
        stdout
            .read_line(&mut line)
            .map_err(|e| format!("the floor process: {e}"))?;
        if line.trim() != "ready" {
            return Err(format!("the floor process did not start: {line:?}"));
        }
        children.push((child, stdout));
    }
    for (child, _) in &mut children {
        let stdin = child.stdin.as_mut().expect("piped");
        writeln!(stdin).map_err(|e| format!("the floor process: {e}"))?;
    }
    let mut samples = Vec::with_capacity(per * processes);
    let mut rate = 0.0;
    let mut usage = [0u64; 4];
    for (mut child, stdout) in children {
        let mut elapsed = None;
        for line in stdout.lines() {
            let line = line.map_err(|e| format!("the floor process: {e}"))?;
            if let Some(numbers) = line.strip_prefix("usage ") {
                for (total, n) in usage.iter_mut().zip(numbers.split_whitespace()) {
                    *total += n.parse::<u64>().unwrap_or(0);
                }
            } else if let Some(ns) = line.strip_prefix("elapsed ") {
                elapsed = ns.parse::<u64>().ok().map(Duration::from_nanos);
            } else if let Ok(ns) = line.parse::<u64>() {
                samples.push(Duration::from_nanos(ns));
            }
        }
        let _ = child.wait();
        let elapsed = elapsed.ok_or("the floor process ended without its timing")?;
        rate += per as f64 / elapsed.as_secs_f64().max(1e-9);
    }
    let n = (per * processes) as f64;
    let profile = format!(
        "per cycle: {:.2} ms CPU and {:.0} faults in the forking process, {:.2} ms CPU and {:.0} faults in the child",
        usage[0] as f64 / 1e3 / n,
        usage[1] as f64 / n,
        usage[2] as f64 / 1e3 / n,
        usage[3] as f64 / n
    );
    Ok(FloorRun {
        samples,
        rate,
        profile,
    })
}
