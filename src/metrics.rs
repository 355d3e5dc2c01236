//! `--metrics ADDR`: Prometheus text on `http://ADDR/metrics`.
//!
//! The issues this solves:
//! 1. The zygote must never have a second thread when it forks, so it cannot
//!    run an HTTP listener. Its numbers live in one page of shared memory (a
//!    memfd, atomics only), written where calls end and children are forked;
//!    whoever serves the endpoint reads that page at scrape time.
//! 2. In `worker` and `sweep` mode the zygote is the whole program: it binds
//!    the address itself (a port in use is a start-up error, exit 2), then
//!    hands the socket and the page to a small process of its own,
//!    `fluksio-zygote metrics-server` (one thread, blocking, dead with the
//!    zygote). In `agent` mode the agent, which never forks Python, serves
//!    the endpoint from its runtime and passes the page to each zygote it
//!    starts. The page is `MADV_DONTFORK` and its fd is the zygote's own
//!    (`crate::fds`): no call's child can read or forge it.
//! 3. Numbers read live at scrape time need no writer: the zygote's resident
//!    memory and its children are read from `/proc` then.
//!
//! The exposition is prometheus-client's (a collector over the page), not
//! written by hand here. Over the usual length: the page's layout and every
//! family read from it are one table, kept in one place.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// The page's fd, across a zygote's re-execution (`recovery`): the server
/// process and the numbers carry on.
const FD_ENV: &str = "FLUKSIO_METRICS_FD";
/// Where the metrics server process finds its listener and the page.
const SERVER_LISTENER_FD: RawFd = 3;
const SERVER_PAGE_FD: RawFd = 4;

/// How a call ended, as the metrics count it (the log line has the error
/// type itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok = 0,
    /// The node raised, or its request or reply was refused.
    Error = 1,
    /// Its process ended without a reply (a crash, `os._exit`, a signal).
    Crashed = 2,
    /// Cancelled by the engine.
    Cancelled = 3,
}

const OUTCOMES: [&str; 4] = ["ok", "error", "crashed", "cancelled"];

impl Outcome {
    /// From the error type of a failed reply.
    pub fn of_error(kind: &str) -> Outcome {
        match kind {
            crate::end::NODE_CANCELLED => Outcome::Cancelled,
            crate::end::REMOTE_ERROR => Outcome::Crashed,
            _ => Outcome::Error,
        }
    }
}

/// Upper bounds in seconds.
const CALL_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0, 600.0,
];
const FORK_BUCKETS: [f64; 11] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 1.0,
];

/// A histogram in the page: a count per bucket (not cumulative; a value
/// past the last bound counts only in `count`), the sum in nanoseconds.
#[repr(C)]
struct Histogram<const N: usize> {
    buckets: [AtomicU64; N],
    sum_ns: AtomicU64,
    count: AtomicU64,
}

impl<const N: usize> Histogram<N> {
    fn observe(&self, bounds: &[f64; N], value: Duration) {
        let seconds = value.as_secs_f64();
        if let Some(i) = bounds.iter().position(|&b| seconds <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.sum_ns
            .fetch_add(value.as_nanos() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// `(sum, count, buckets)`: each bucket's own count (the encoder makes
    /// them cumulative), the last one `+Inf`.
    fn snapshot(&self, bounds: &[f64; N]) -> (f64, u64, Vec<(f64, u64)>) {
        let mut buckets: Vec<(f64, u64)> = bounds
            .iter()
            .zip(&self.buckets)
            .map(|(&bound, n)| (bound, n.load(Ordering::Relaxed)))
            .collect();
        let bounded: u64 = buckets.iter().map(|(_, n)| n).sum();
        let count = self.count.load(Ordering::Relaxed).max(bounded);
        buckets.push((f64::INFINITY, count - bounded));
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        (sum, count, buckets)
    }
}

/// The shared page. All zeroes is a valid, empty one.
#[repr(C)]
pub struct Stats {
    /// The zygote writing fork numbers, whose `/proc` entry is read.
    zygote_pid: AtomicU64,
    calls: [AtomicU64; 4],
    call_seconds: Histogram<14>,
    fork_seconds: Histogram<11>,
    reconnects: AtomicU64,
    /// A sweep's calls by GPU slot (`--gpus`), and each slot's GPU index
    /// plus one (0: not an index, a UUID; labelled by position then).
    gpu_calls: [AtomicU64; GPU_SLOTS],
    gpu_ids: [AtomicU64; GPU_SLOTS],
    /// `--isolation reset`: residents that could not be put back.
    reset_retired: AtomicU64,
}

/// The most GPUs a sweep's metrics count apart.
const GPU_SLOTS: usize = 64;

const PAGE: usize = 4096;
const _: () = assert!(std::mem::size_of::<Stats>() <= PAGE);

static STATS: OnceLock<&'static Stats> = OnceLock::new();
/// The page's fd in a zygote (-1: none), for the node zygotes it forks.
static PAGE_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
/// The process that mapped the page: a forked child has no mapping there
/// (`MADV_DONTFORK`), so it must never write.
static OWNER: AtomicU64 = AtomicU64::new(0);

/// The page, in the process that mapped it.
fn stats() -> Option<&'static Stats> {
    let stats = STATS.get()?;
    if OWNER.load(Ordering::Relaxed) != u64::from(std::process::id()) {
        return None;
    }
    let remapped = REMAPPED.load(Ordering::Relaxed);
    if remapped.is_null() {
        Some(*stats)
    } else {
        // SAFETY: set once by `adopt_in_node_zygote` to a mapping that is
        // never unmapped.
        Some(unsafe { &*remapped })
    }
}

/// A call ended (no-op without `--metrics`).
pub fn call_ended(outcome: Outcome, took: Duration) {
    if let Some(stats) = stats() {
        stats.calls[outcome as usize].fetch_add(1, Ordering::Relaxed);
        stats.call_seconds.observe(&CALL_BUCKETS, took);
    }
}

/// A sweep's GPUs, in `--gpus` order (no-op without `--metrics`).
pub fn name_gpus(ids: &[String]) {
    if let Some(stats) = stats() {
        for (slot, id) in stats.gpu_ids.iter().zip(ids) {
            slot.store(id.parse::<u64>().map_or(0, |i| i + 1), Ordering::Relaxed);
        }
    }
}

/// A sweep's call ended on the GPU at `position` in `--gpus`.
pub fn gpu_call_ended(position: usize) {
    if let Some(slot) = stats().and_then(|stats| stats.gpu_calls.get(position)) {
        slot.fetch_add(1, Ordering::Relaxed);
    }
}

/// The zygote forked a child; `took` is the fork as the zygote saw it.
pub fn forked(took: Duration) {
    if let Some(stats) = stats() {
        stats.fork_seconds.observe(&FORK_BUCKETS, took);
    }
}

/// A resident could not be put back after its call (`--isolation reset`):
/// a fresh fork serves the next.
pub fn reset_retired() {
    RESET_RETIRED.fetch_add(1, Ordering::Relaxed);
    if let Some(stats) = stats() {
        stats.reset_retired.fetch_add(1, Ordering::Relaxed);
    }
}

/// Residents of this process that could not be put back, so far.
pub fn reset_retired_so_far() -> u64 {
    RESET_RETIRED.load(Ordering::Relaxed)
}

static RESET_RETIRED: AtomicU64 = AtomicU64::new(0);

/// The agent is connecting again after losing (or failing) a connection.
pub fn reconnecting() {
    if let Some(stats) = stats() {
        stats.reconnects.fetch_add(1, Ordering::Relaxed);
    }
}

/// A new page: a memfd, not close-on-exec when `keep_across_exec`.
fn create(keep_across_exec: bool) -> std::io::Result<OwnedFd> {
    let flags = if keep_across_exec {
        0
    } else {
        libc::MFD_CLOEXEC
    };
    // SAFETY: a static C string; the fd is checked and owned below.
    let fd = unsafe { libc::memfd_create(c"fluksio-metrics".as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // Above the fds a child is given (3, 4), so a dup2 onto those never
    // overwrites it.
    // SAFETY: a new fd nobody else owns; F_DUPFD makes another.
    let high = unsafe {
        let high = libc::fcntl(
            fd,
            if keep_across_exec {
                libc::F_DUPFD
            } else {
                libc::F_DUPFD_CLOEXEC
            },
            10,
        );
        libc::close(fd);
        high
    };
    if high < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    let fd = unsafe { OwnedFd::from_raw_fd(high) };
    // SAFETY: ftruncate on the memfd just made.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), PAGE as libc::off_t) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}

/// Maps the page, for the rest of this process. `dont_fork`: a forked child
/// does not get the mapping (the zygote's).
fn map(fd: BorrowedFd<'_>, dont_fork: bool) -> std::io::Result<&'static Stats> {
    // SAFETY: a shared mapping of a PAGE-sized memfd, never unmapped, so the
    // reference lives as long as the process; Stats is atomics only, valid
    // as all zeroes, and the other side writes it only through atomics.
    unsafe {
        let at = libc::mmap(
            std::ptr::null_mut(),
            PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        );
        if at == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        if dont_fork && libc::madvise(at, PAGE, libc::MADV_DONTFORK) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(&*(at as *const Stats))
    }
}

fn install(stats: &'static Stats) {
    OWNER.store(std::process::id().into(), Ordering::Relaxed);
    let _ = STATS.set(stats);
}

/// Why `--metrics` cannot be served: printed as is, exit 2.
fn bind_error(addr: &str, error: &std::io::Error) -> String {
    let hint = if error.kind() == std::io::ErrorKind::AddrInUse {
        "another process listens there: pick another port (--metrics 127.0.0.1:9464), or stop that process"
    } else {
        "give --metrics a local address and port, e.g. 127.0.0.1:9464 or 0.0.0.0:9464"
    };
    format!("could not listen on {addr} for --metrics: {error}\nhint: {hint}")
}

fn bind(addr: &str) -> Result<std::net::TcpListener, String> {
    std::net::TcpListener::bind(addr).map_err(|e| bind_error(addr, &e))
}

/// `worker` and `sweep`: binds `addr` and starts the metrics server
/// process. Call while this process has one thread, before the zygote boots.
/// After a re-execution of the zygote, picks up the page it had instead.
pub fn serve_for_zygote(addr: &str) -> Result<(), String> {
    if let Some(fd) = std::env::var(FD_ENV)
        .ok()
        .and_then(|fd| fd.parse::<RawFd>().ok())
    {
        // SAFETY: the fd this variable names was left open across exec for
        // exactly this; it stays open for the process's life.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        if let Ok(stats) = map(fd, true) {
            stats
                .zygote_pid
                .store(std::process::id().into(), Ordering::Relaxed);
            install(stats);
            PAGE_FD.store(fd.as_raw_fd(), Ordering::Relaxed);
            return Ok(());
        }
    }
    let listener = bind(addr)?;
    let page = create(true).map_err(|e| format!("could not set up --metrics: {e}"))?;
    let stats = map(std::os::fd::AsFd::as_fd(&page), true)
        .map_err(|e| format!("could not set up --metrics: {e}"))?;
    stats
        .zygote_pid
        .store(std::process::id().into(), Ordering::Relaxed);
    spawn_server(&listener, &page)
        .map_err(|e| format!("could not start the metrics server: {e}"))?;
    let shown = listener
        .local_addr()
        .map_or(addr.to_string(), |a| a.to_string());
    drop(listener);
    // The page's fd stays open (and is the zygote's own: `crate::fds` claims
    // what the process holds when it boots) for a re-executed zygote.
    let fd = std::mem::ManuallyDrop::new(page).as_raw_fd();
    // SAFETY: one thread so far (the zygote has not booted).
    unsafe { std::env::set_var(FD_ENV, fd.to_string()) };
    install(stats);
    PAGE_FD.store(fd, Ordering::Relaxed);
    tracing::info!("metrics on http://{shown}/metrics");
    Ok(())
}

fn spawn_server(listener: &std::net::TcpListener, page: &OwnedFd) -> std::io::Result<()> {
    let (listener_fd, page_fd) = (listener.as_raw_fd(), page.as_raw_fd());
    let mut command = std::process::Command::new(std::env::current_exe()?);
    command
        .arg("metrics-server")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null());
    crate::process::Start {
        fds: vec![(listener_fd, SERVER_LISTENER_FD), (page_fd, SERVER_PAGE_FD)],
        dies_with_parent: true,
        ..Default::default()
    }
    .on(&mut command);
    command.spawn().map(|_| ())
}

/// `fluksio-zygote metrics-server` (internal): answers scrapes on the
/// inherited listener from the inherited page, until its zygote dies.
pub fn server_main() -> std::process::ExitCode {
    // SAFETY: the zygote passed these fds to this process alone.
    let listener = unsafe { std::net::TcpListener::from_raw_fd(SERVER_LISTENER_FD) };
    let page = unsafe { OwnedFd::from_raw_fd(SERVER_PAGE_FD) };
    let stats = match map(std::os::fd::AsFd::as_fd(&page), false) {
        Ok(stats) => stats,
        Err(error) => {
            eprintln!("fluksio-zygote metrics-server: {error}");
            return std::process::ExitCode::from(2);
        }
    };
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
        let mut head = Vec::new();
        let mut reader = BufReader::new(&mut stream);
        let mut line = String::new();
        while reader.read_line(&mut line).is_ok_and(|n| n > 0) && head.len() < 16384 {
            let end = line == "\r\n" || line == "\n";
            head.extend_from_slice(line.as_bytes());
            line.clear();
            if end {
                break;
            }
        }
        let _ = stream.write_all(&respond(&head, stats));
    }
    std::process::ExitCode::SUCCESS
}

/// `agent`: binds `addr` (before the runtime starts, so a port in use is a
/// start-up error) and makes the page the zygotes write into.
pub fn prepare_for_agent(addr: &str) -> Result<(std::net::TcpListener, OwnedFd), String> {
    let listener = bind(addr)?;
    let page = create(false).map_err(|e| format!("could not set up --metrics: {e}"))?;
    let stats = map(std::os::fd::AsFd::as_fd(&page), true)
        .map_err(|e| format!("could not set up --metrics: {e}"))?;
    install(stats);
    Ok((listener, page))
}

/// The agent's zygote: writes into the page its agent made.
pub fn attach_zygote(fd: RawFd) {
    // SAFETY: the agent passed this fd for this; it stays open (the zygote's
    // own, claimed at boot) for the process's life.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    match map(fd, true) {
        Ok(stats) => {
            stats
                .zygote_pid
                .store(std::process::id().into(), Ordering::Relaxed);
            install(stats);
            PAGE_FD.store(fd.as_raw_fd(), Ordering::Relaxed);
        }
        Err(error) => tracing::warn!("no metrics from this zygote: {error}"),
    }
}

/// In a node's own zygote (`zygote::app`), just forked, before its
/// parent's fds are closed: maps the page again (a fork does not get it),
/// so its forks and calls are counted with its parent's.
pub fn adopt_in_node_zygote() {
    let fd = PAGE_FD.load(Ordering::Relaxed);
    if fd < 0 || STATS.get().is_none() {
        return;
    }
    // SAFETY: the parent's page fd, still open in this fresh fork.
    let page = unsafe { BorrowedFd::borrow_raw(fd) };
    if let Ok(stats) = map(page, true) {
        // A new mapping, at another address than the parent's (which this
        // fork does not have): the one this process writes through.
        REMAPPED.store(stats as *const Stats as *mut Stats, Ordering::Relaxed);
        OWNER.store(std::process::id().into(), Ordering::Relaxed);
    }
}

/// A node zygote's own mapping of the page (null elsewhere).
static REMAPPED: std::sync::atomic::AtomicPtr<Stats> =
    std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());

/// The agent's endpoint, on its runtime.
pub async fn serve_agent(listener: std::net::TcpListener) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = listener.set_nonblocking(true);
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    let Some(stats) = stats() else { return };
    tracing::info!(
        "metrics on http://{}/metrics",
        listener
            .local_addr()
            .map_or_else(|_| "?".to_string(), |a| a.to_string())
    );
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(async move {
            let mut head = Vec::new();
            let mut buffer = [0u8; 2048];
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                while !head.windows(4).any(|w| w == b"\r\n\r\n")
                    && !head.windows(2).any(|w| w == b"\n\n")
                    && head.len() < 16384
                {
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buffer[..n]),
                    }
                }
            })
            .await;
            if read.is_ok() {
                let _ = stream.write_all(&respond(&head, stats)).await;
            }
            let _ = stream.shutdown().await;
        });
    }
}

/// The HTTP answer to one request head.
fn respond(head: &[u8], stats: &'static Stats) -> Vec<u8> {
    let head = String::from_utf8_lossy(head);
    let mut parts = head.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, kind, body) = match (method, path) {
        ("GET" | "HEAD", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            render(stats),
        ),
        ("GET" | "HEAD", "/") => (
            "200 OK",
            "text/plain; charset=utf-8",
            "fluksio-zygote: metrics at /metrics\n".to_string(),
        ),
        _ => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "not found: metrics are at /metrics\n".to_string(),
        ),
    };
    let mut response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if method != "HEAD" {
        response.extend_from_slice(body.as_bytes());
    }
    response
}

/// The exposition of the page, and of what `/proc` says now.
pub fn render(stats: &'static Stats) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Collect(stats)));
    let mut text = String::new();
    let _ = prometheus_client::encoding::prometheus_text::encode(&mut text, &registry);
    text
}

struct Collect(&'static Stats);

impl std::fmt::Debug for Collect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("metrics page")
    }
}

impl prometheus_client::collector::Collector for Collect {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stats = self.0;
        let mut calls = encoder.encode_descriptor(
            "fluksio_calls",
            "Calls by how they ended: ok, error (the node raised, or the call was refused), \
             crashed (its process ended without a reply), cancelled",
            None,
            MetricType::Counter,
        )?;
        for (name, count) in OUTCOMES.iter().zip(&stats.calls) {
            let labels = [("outcome", *name)];
            ConstCounter::new(count.load(Ordering::Relaxed))
                .encode(calls.encode_family(&labels)?)?;
        }
        histogram(
            &mut encoder,
            "fluksio_call_duration_seconds",
            "Calls from request to reply",
            stats.call_seconds.snapshot(&CALL_BUCKETS),
        )?;
        histogram(
            &mut encoder,
            "fluksio_fork_duration_seconds",
            "Forking a child from the zygote, as the zygote sees it",
            stats.fork_seconds.snapshot(&FORK_BUCKETS),
        )?;
        let retired = ConstCounter::new(stats.reset_retired.load(Ordering::Relaxed));
        retired.encode(encoder.encode_descriptor(
            "fluksio_reset_retired",
            "Residents under --isolation reset that a call left in a state they cannot be \
             put back from (a fresh fork served the next call)",
            None,
            retired.metric_type(),
        )?)?;
        let named = stats
            .gpu_ids
            .iter()
            .filter(|id| id.load(Ordering::Relaxed) > 0)
            .count();
        let counted = stats
            .gpu_calls
            .iter()
            .filter(|n| n.load(Ordering::Relaxed) > 0)
            .count();
        if named + counted > 0 {
            let mut by_gpu = encoder.encode_descriptor(
                "fluksio_sweep_gpu_calls",
                "A sweep's calls by the GPU they ran on (--gpus): its index, or its position \
                 in --gpus as #N where it was given by UUID",
                None,
                MetricType::Counter,
            )?;
            for (position, (count, id)) in stats.gpu_calls.iter().zip(&stats.gpu_ids).enumerate() {
                let (count, id) = (count.load(Ordering::Relaxed), id.load(Ordering::Relaxed));
                if count == 0 && id == 0 {
                    continue;
                }
                let label = if id > 0 {
                    (id - 1).to_string()
                } else {
                    format!("#{position}")
                };
                let labels = [("gpu", label.as_str())];
                ConstCounter::new(count).encode(by_gpu.encode_family(&labels)?)?;
            }
        }
        let reconnects = ConstCounter::new(stats.reconnects.load(Ordering::Relaxed));
        reconnects.encode(encoder.encode_descriptor(
            "fluksio_reconnects",
            "Times the agent connected to the engine again after losing or failing a connection",
            None,
            reconnects.metric_type(),
        )?)?;
        let pid = stats.zygote_pid.load(Ordering::Relaxed) as i32;
        if pid > 0 {
            let rss = ConstGauge::new(resident_bytes(pid));
            rss.encode(encoder.encode_descriptor(
                "fluksio_zygote_resident_bytes",
                "The zygote's resident memory",
                None,
                rss.metric_type(),
            )?)?;
            let children = ConstGauge::new(children_alive(pid));
            children.encode(encoder.encode_descriptor(
                "fluksio_children",
                "Processes the zygote forked and has not reaped: calls in flight and standby \
                 children",
                None,
                children.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

fn histogram(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    (sum, count, buckets): (f64, u64, Vec<(f64, u64)>),
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
    metric.encode_histogram::<prometheus_client::encoding::NoLabelSet>(sum, count, &buckets, None)
}

fn resident_bytes(pid: i32) -> i64 {
    let pages = std::fs::read_to_string(format!("/proc/{pid}/statm"))
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<i64>().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as i64
}

/// The zygote's children, less the processes it runs that are no call's: the
/// metrics server and the warden.
fn children_alive(pid: i32) -> i64 {
    let Ok(list) = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")) else {
        return 0;
    };
    list.split_whitespace()
        .filter(|child| {
            let cmdline = std::fs::read(format!("/proc/{child}/cmdline")).unwrap_or_default();
            let role = cmdline.split(|&b| b == 0).nth(1).unwrap_or_default();
            role != b"metrics-server" && role != b"warden"
        })
        .count() as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_renders_as_prometheus_text() {
        let page = create(false).unwrap();
        let stats = map(std::os::fd::AsFd::as_fd(&page), false).unwrap();
        stats.calls[Outcome::Ok as usize].fetch_add(3, Ordering::Relaxed);
        stats
            .call_seconds
            .observe(&CALL_BUCKETS, Duration::from_millis(3));
        stats
            .fork_seconds
            .observe(&FORK_BUCKETS, Duration::from_secs(5));
        let text = render(stats);
        assert!(
            text.contains("fluksio_calls_total{outcome=\"ok\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("fluksio_call_duration_seconds_bucket{le=\"0.005\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("fluksio_fork_duration_seconds_count 1"),
            "{text}"
        );
    }
}
