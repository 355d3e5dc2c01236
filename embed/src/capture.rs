//! A call's logs: what its node wrote to `sys.stdout` and `sys.stderr`.
//!
//! The issues this solves:
//! 1. The contract keeps the first 16 KiB (16,384 characters) of a call's
//!    output and quietly drops the rest, as `worker_main.py`'s `_Capped`.
//! 2. A node that prints and then segfaults should not take its prints with
//!    it: they are what says how far it got. So the capture does not live in
//!    the child's heap but in a [`LogBuffer`], a small shared mapping the
//!    zygote made before forking, which it reads after the child is gone.
//! 3. A `str` may hold lone surrogates, which UTF-8 cannot; they are stored
//!    as `surrogatepass` bytes and decoded the same way, so the logs that
//!    reach `json.dumps` are the very string the node printed.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicPtr, Ordering};

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

/// Enough of a print to debug with. A node printing in a loop must not fill
/// the pipe or the reply. Characters, as `worker_main.py` counts them.
pub const MAX_LOG_CHARS: usize = 16 * 1024;
/// Room for the worst case: every kept character four bytes long.
const DATA_BYTES: usize = MAX_LOG_CHARS * 4;

/// Room for a child's report to its zygote, beside its logs
/// ([`LogBuffer::set_report`]): the modules a call imported, or why a
/// warm-up was refused.
const REPORT_BYTES: usize = 64 * 1024;

#[repr(C)]
struct Header {
    /// Bytes of data written so far.
    bytes: usize,
    /// Characters they encode, to enforce the cap in the contract's unit.
    chars: usize,
    /// Bytes of the report.
    report: usize,
}

const MAPPING_BYTES: usize = std::mem::size_of::<Header>() + DATA_BYTES + REPORT_BYTES;

/// A capture that outlives the process writing it: anonymous shared memory.
pub struct LogBuffer {
    base: NonNull<Header>,
}

// SAFETY: the mapping is plain memory owned by this value; writers in other
// processes only ever see their own copy-free view of it, and within one
// process every write happens under the GIL.
unsafe impl Send for LogBuffer {}
// SAFETY: as for Send: shared access only reads the mapping, or writes it
// under the GIL.
unsafe impl Sync for LogBuffer {}

impl LogBuffer {
    pub fn new() -> std::io::Result<LogBuffer> {
        // SAFETY: a fresh anonymous mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                MAPPING_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let base = NonNull::new(base.cast::<Header>()).expect("mmap never returns null");
        MAPPED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(base.as_ptr() as usize);
        Ok(LogBuffer { base })
    }

    /// In a freshly forked child: unmaps every log buffer but this one. A
    /// child that kept them could read what other calls print, through
    /// `/proc/self/mem`, and forge it.
    pub fn unmap_all_others(&self) {
        let mapped = MAPPED.lock().unwrap_or_else(|e| e.into_inner());
        for &base in mapped.iter() {
            if base != self.base.as_ptr() as usize {
                // SAFETY: every address in MAPPED is a live mapping of
                // MAPPING_BYTES made by `new`; this child never touches the
                // other buffers (their owners are the zygote's structures,
                // which the child leaves with `_exit`, never dropping them).
                unsafe { libc::munmap(base as *mut libc::c_void, MAPPING_BYTES) };
            }
        }
    }

    /// In a node's own zygote, just forked: unmaps every log buffer it
    /// inherited (its parent's calls', which its module-level code must not
    /// reach). Their owners are its parent's structures, never dropped here.
    pub fn unmap_inherited() {
        let mut mapped = MAPPED.lock().unwrap_or_else(|e| e.into_inner());
        for base in mapped.drain(..) {
            // SAFETY: as in `unmap_all_others`.
            unsafe { libc::munmap(base as *mut libc::c_void, MAPPING_BYTES) };
        }
    }

    /// (bytes, chars) written so far.
    fn counts(&self) -> (usize, usize) {
        // SAFETY: the mapping starts with a Header and lives as long as self.
        let header = unsafe { &*self.base.as_ptr() };
        (header.bytes, header.chars)
    }

    fn set_counts(&self, bytes: usize, chars: usize) {
        // SAFETY: as in `counts`; writers are serialised by the GIL (within a
        // process) and by the zygote reading only buffers no child writes.
        unsafe {
            let header = self.base.as_ptr();
            (*header).bytes = bytes;
            (*header).chars = chars;
        }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: the data area follows the header inside the mapping.
        unsafe { self.base.as_ptr().add(1).cast::<u8>() }
    }

    /// Empties the buffer for its next call. The bytes are zeroed, not
    /// just forgotten: the next call's child maps this buffer, and must not
    /// find what the last call printed.
    pub fn clear(&self) {
        let written = self.counts().0.min(DATA_BYTES);
        // SAFETY: `written` bytes from the start of the data area are inside
        // the mapping; no child writes a buffer the zygote is clearing.
        unsafe { std::ptr::write_bytes(self.data(), 0, written) };
        self.set_counts(0, 0);
        self.take_report();
    }

    fn report_area(&self) -> *mut u8 {
        // SAFETY: the report area follows the data area inside the mapping.
        unsafe { self.data().add(DATA_BYTES) }
    }

    /// In a child: what it tells its zygote beside its logs (read once it
    /// has ended, [`LogBuffer::take_report`]). Longer than the room is cut.
    pub fn set_report(&self, report: &[u8]) {
        let len = report.len().min(REPORT_BYTES);
        // SAFETY: `len` bytes fit the report area; the header is ours.
        unsafe {
            std::ptr::copy_nonoverlapping(report.as_ptr(), self.report_area(), len);
            (*self.base.as_ptr()).report = len;
        }
    }

    /// In the zygote, once the child has ended: its report, zeroed here so
    /// that the next call's child does not find it.
    pub fn take_report(&self) -> Vec<u8> {
        // SAFETY: the header is ours; the child that wrote it has ended.
        let len = unsafe { (*self.base.as_ptr()).report }.min(REPORT_BYTES);
        if len == 0 {
            return Vec::new();
        }
        // SAFETY: `len` bytes of the report area, written by `set_report`.
        let report = unsafe { std::slice::from_raw_parts(self.report_area(), len) }.to_vec();
        // SAFETY: as above.
        unsafe {
            std::ptr::write_bytes(self.report_area(), 0, len);
            (*self.base.as_ptr()).report = 0;
        }
        report
    }

    /// Makes this buffer hold what `other` holds (a trial's output, which a
    /// run's logs start with).
    pub fn copy_from(&self, other: &LogBuffer) {
        self.clear();
        self.append(other.bytes(), other.counts().1);
    }

    /// The stored bytes (UTF-8, with surrogates as `surrogatepass` writes them).
    pub fn bytes(&self) -> &[u8] {
        let len = self.counts().0.min(DATA_BYTES);
        // SAFETY: `len` bytes of the data area were written by `append`.
        unsafe { std::slice::from_raw_parts(self.data(), len) }
    }

    /// The logs, for a reply the zygote writes itself.
    pub fn text_lossy(&self) -> String {
        String::from_utf8_lossy(self.bytes()).into_owned()
    }

    /// Characters that can still be kept.
    fn room(&self) -> usize {
        MAX_LOG_CHARS.saturating_sub(self.counts().1)
    }

    fn append(&self, bytes: &[u8], chars: usize) {
        let (written, counted) = self.counts();
        let len = bytes.len().min(DATA_BYTES - written);
        // SAFETY: the copy stays inside the data area (len is clamped above).
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.data().add(written), len);
        }
        self.set_counts(written + len, counted + chars);
    }

    /// Makes this the buffer every [`LogCapture`] in this process writes to.
    pub fn capture_here(&self) {
        TARGET.store(self.base.as_ptr(), Ordering::SeqCst);
    }
}

impl Drop for LogBuffer {
    fn drop(&mut self) {
        let _ = TARGET.compare_exchange(
            self.base.as_ptr(),
            std::ptr::null_mut(),
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
        MAPPED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|&base| base != self.base.as_ptr() as usize);
        // SAFETY: the mapping was made in `new` with this size.
        unsafe { libc::munmap(self.base.as_ptr().cast(), MAPPING_BYTES) };
    }
}

/// Every log buffer this process has mapped, by address.
static MAPPED: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());

/// Where captures in this process write now; null drops what they get.
static TARGET: AtomicPtr<Header> = AtomicPtr::new(std::ptr::null_mut());

fn target() -> Option<LogBuffer> {
    NonNull::new(TARGET.load(Ordering::SeqCst)).map(|base| LogBuffer { base })
}

/// Runs `f` with the current target, never unmapping it (it is borrowed).
fn with_target<R>(f: impl FnOnce(&LogBuffer) -> R) -> Option<R> {
    let buffer = std::mem::ManuallyDrop::new(target()?);
    Some(f(&buffer))
}

/// What the current capture holds, as the `str` that was written: read
/// from the buffer itself, so a node that replaced `sys.stdout` still has
/// what it printed before.
pub fn current_logs(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let bytes = with_target(|buffer| buffer.bytes().to_vec()).unwrap_or_default();
    decode(py, &bytes)
}

/// What the current capture holds, for a reply written without Python.
pub fn current_text() -> String {
    with_target(|buffer| buffer.text_lossy()).unwrap_or_default()
}

/// Stops capturing in this process: writes are dropped until the next
/// [`LogBuffer::capture_here`].
pub fn drop_writes() {
    TARGET.store(std::ptr::null_mut(), Ordering::SeqCst);
}

/// Whether what a call prints also goes to its stderr as it is written
/// (`run`: the node's output live on the terminal, uncapped). Set before
/// any child is forked; children inherit it.
static TEE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Turns on the copy of every captured write to fd 2 (see `TEE`).
pub fn tee_to_stderr() {
    TEE.store(true, Ordering::Relaxed);
}

/// The copy [`tee_to_stderr`] asks for; only while a capture is current
/// (output the zygote drops, a node loaded quietly into it, stays dropped).
fn tee(text: &Bound<'_, PyString>) {
    if !TEE.load(Ordering::Relaxed) || TARGET.load(Ordering::SeqCst).is_null() {
        return;
    }
    let text = text.to_string_lossy();
    let mut bytes = text.as_bytes();
    while !bytes.is_empty() {
        // SAFETY: a write from a live slice to this process's fd 2.
        let n = unsafe { libc::write(2, bytes.as_ptr().cast(), bytes.len()) };
        if n <= 0 {
            if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        bytes = &bytes[n as usize..];
    }
}

/// `sys.stdout` and `sys.stderr` during a call: a text stream into the
/// current [`LogBuffer`], first [`MAX_LOG_CHARS`] characters kept.
#[pyclass(module = "fluksio", frozen)]
pub struct LogCapture;

#[pymethods]
impl LogCapture {
    /// Keeps what fits and, as `io.StringIO`, answers the whole length.
    fn write(&self, text: &Bound<'_, PyAny>) -> PyResult<usize> {
        let text = text.cast::<PyString>().map_err(|_| {
            PyTypeError::new_err(format!(
                "string argument expected, got '{}'",
                text.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?;
        let chars = text.len()?;
        tee(text);
        with_target(|buffer| -> PyResult<()> {
            let room = buffer.room();
            if room == 0 {
                return Ok(());
            }
            let kept = chars.min(room);
            let part = if kept < chars {
                crate::objects::str_prefix(text, kept)?
            } else {
                text.clone()
            };
            match part.to_str() {
                Ok(utf8) => buffer.append(utf8.as_bytes(), kept),
                Err(_) => {
                    let encoded = part.call_method1("encode", ("utf-8", "surrogatepass"))?;
                    buffer.append(encoded.cast::<PyBytes>()?.as_bytes(), kept);
                }
            }
            Ok(())
        })
        .transpose()?;
        Ok(chars)
    }

    fn writelines(&self, lines: &Bound<'_, PyAny>) -> PyResult<()> {
        for line in lines.try_iter()? {
            self.write(&line?)?;
        }
        Ok(())
    }

    /// Everything kept so far.
    fn getvalue<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let bytes = with_target(|buffer| buffer.bytes().to_vec()).unwrap_or_default();
        decode(py, &bytes)
    }

    fn flush(&self) {}

    fn isatty(&self) -> bool {
        false
    }

    fn writable(&self) -> bool {
        true
    }

    fn readable(&self) -> bool {
        false
    }

    fn seekable(&self) -> bool {
        false
    }

    fn fileno(&self, py: Python<'_>) -> PyResult<i32> {
        // io.UnsupportedOperation, as a StringIO raises: faulthandler and
        // friends catch exactly that.
        let unsupported = py.import("io")?.getattr("UnsupportedOperation")?;
        Err(PyErr::from_value(unsupported.call1(("fileno",))?))
    }

    fn close(&self) {}

    #[getter]
    fn closed(&self) -> bool {
        false
    }

    #[getter]
    fn encoding(&self) -> &'static str {
        "utf-8"
    }

    #[getter]
    fn errors(&self) -> &'static str {
        "strict"
    }

    #[getter]
    fn line_buffering(&self) -> bool {
        false
    }

    #[getter]
    fn newlines(&self) -> Option<()> {
        None
    }

    fn __repr__(&self) -> &'static str {
        "<fluksio log capture>"
    }
}

/// Bytes the capture stored, back into the `str` that was written.
pub fn decode<'py>(py: Python<'py>, bytes: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    match std::str::from_utf8(bytes) {
        Ok(text) => Ok(PyString::new(py, text).into_any()),
        Err(_) => PyBytes::new(py, bytes).call_method1("decode", ("utf-8", "surrogatepass")),
    }
}

/// Points `sys.stdout` and `sys.stderr` at a capture, and registers the
/// capture as a text stream for code that checks `isinstance`.
pub fn redirect_stdio(py: Python<'_>) -> PyResult<()> {
    let capture = Bound::new(py, LogCapture)?;
    let sys = py.import("sys")?;
    sys.setattr("stdout", &capture)?;
    sys.setattr("stderr", &capture)?;
    Ok(())
}

/// Makes `LogCapture` an `io.TextIOBase` for `isinstance` checks.
pub fn register_as_text_stream(py: Python<'_>) -> PyResult<()> {
    py.import("io")?
        .getattr("TextIOBase")?
        .call_method1("register", (py.get_type::<LogCapture>(),))?;
    Ok(())
}

/// Runs `f` with `sys.stdout`/`sys.stderr` captured into nothing.
pub fn quietly<'py, R>(py: Python<'py>, f: impl FnOnce() -> PyResult<R>) -> PyResult<R> {
    let sys = py.import("sys")?;
    let (stdout, stderr) = (sys.getattr("stdout")?, sys.getattr("stderr")?);
    drop_writes();
    redirect_stdio(py)?;
    let result = f();
    sys.setattr("stdout", stdout)?;
    sys.setattr("stderr", stderr)?;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_is_read_once_then_gone() {
        let buffer = LogBuffer::new().unwrap();
        buffer.set_report(b"imported\nnumpy");
        assert_eq!(buffer.take_report(), b"imported\nnumpy");
        assert!(buffer.take_report().is_empty());
    }

    #[test]
    fn logs_are_capped_in_characters_and_cleared_to_zeros() {
        let buffer = LogBuffer::new().unwrap();
        let text = "é".repeat(MAX_LOG_CHARS);
        buffer.append(text.as_bytes(), MAX_LOG_CHARS);
        assert_eq!(buffer.room(), 0);
        assert_eq!(buffer.text_lossy(), text);
        buffer.clear();
        assert!(buffer.bytes().is_empty());
        // SAFETY: the data area is inside the mapping, which `buffer` owns.
        let data = unsafe { std::slice::from_raw_parts(buffer.data(), text.len()) };
        assert!(data.iter().all(|&b| b == 0));
    }
}
