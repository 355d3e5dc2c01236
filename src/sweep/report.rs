//! What a sweep writes: one JSON line per call as it ends, a progress bar on
//! a terminal, and a summary that lists the failures by error type.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::calls::Done;
use crate::end::End;

/// The parts of a reply a line carries, kept as the JSON they came as (a
/// big int stays exact).
#[derive(Deserialize)]
pub struct Reply<'a> {
    pub ok: bool,
    #[serde(borrow, default)]
    pub result: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub error: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub logs: Option<&'a RawValue>,
}

impl Reply<'_> {
    pub fn logs_text(&self) -> String {
        self.logs
            .and_then(|raw| serde_json::from_str::<String>(raw.get()).ok())
            .unwrap_or_default()
    }

    pub fn error_body(&self) -> ErrorBody {
        self.error
            .and_then(|e| serde_json::from_str::<ErrorBody>(e.get()).ok())
            .unwrap_or_default()
    }
}

/// A reply's error, as a person reads it.
#[derive(Deserialize, Default)]
pub struct ErrorBody {
    #[serde(rename = "type", default)]
    pub kind: String,
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub short: String,
    #[serde(default)]
    pub traceback: String,
}

#[derive(Deserialize)]
struct Event<'a> {
    event: &'a str,
    #[serde(borrow)]
    outputs: Option<&'a RawValue>,
}

/// An event line as a call's line carries it: `{"event", "outputs"}`.
pub fn event_json(line: &[u8]) -> String {
    match serde_json::from_slice::<Event<'_>>(line) {
        Ok(event) => format!(
            r#"{{"event": {}, "outputs": {}}}"#,
            Value::from(event.event),
            event.outputs.map_or("null", |o| o.get())
        ),
        Err(_) => Value::from(String::from_utf8_lossy(line).trim()).to_string(),
    }
}

/// How a call ended, for the summary.
pub struct Outcome {
    pub ok: bool,
    pub kind: String,
    pub short: String,
}

/// `{"index", "kwargs", "ok", "result" | "error", "events"?, "logs"?,
/// "gpu"?, "duration_ms"}`, and how the call ended.
pub fn line(done: &Done, kwargs: &Map<String, Value>, gpu: Option<&str>) -> (String, Outcome) {
    let kwargs = Value::Object(kwargs.clone());
    let mut line = format!(r#"{{"index": {}, "kwargs": {kwargs}"#, done.index);
    let reply = serde_json::from_slice::<Reply<'_>>(&done.answer.reply);
    let outcome = match &reply {
        Ok(reply) => {
            line += &format!(r#", "ok": {}"#, reply.ok);
            if reply.ok {
                line += &format!(
                    r#", "result": {}"#,
                    reply.result.map_or("null", |r| r.get())
                );
                Outcome {
                    ok: true,
                    kind: String::new(),
                    short: String::new(),
                }
            } else {
                line += &format!(r#", "error": {}"#, reply.error.map_or("null", |e| e.get()));
                let body = reply.error_body();
                Outcome {
                    ok: false,
                    short: if body.short.is_empty() {
                        body.message
                    } else {
                        body.short
                    },
                    kind: if body.kind.is_empty() {
                        "Error".into()
                    } else {
                        body.kind
                    },
                }
            }
        }
        Err(_) => {
            let text = String::from_utf8_lossy(&done.answer.reply);
            let end = End::Lost(format!("unreadable reply: {}", text.trim()));
            let message = end.to_string();
            let error = serde_json::json!({"type": end.error_type(), "message": message, "short": message, "traceback": ""});
            line += &format!(r#", "ok": false, "error": {error}"#);
            Outcome {
                ok: false,
                kind: end.error_type().into(),
                short: message,
            }
        }
    };
    if !done.answer.events.is_empty() {
        let events: Vec<String> = done.answer.events.iter().map(|e| event_json(e)).collect();
        line += &format!(r#", "events": [{}]"#, events.join(", "));
    }
    if let Ok(reply) = &reply
        && let Some(logs) = reply.logs.filter(|l| l.get() != r#""""#)
    {
        line += &format!(r#", "logs": {}"#, logs.get());
    }
    if let Some(gpu) = gpu {
        line += &format!(r#", "gpu": {}"#, Value::from(gpu));
    }
    line += &format!(
        r#", "duration_ms": {:.3}}}"#,
        done.duration.as_secs_f64() * 1000.0
    );
    (line, outcome)
}

/// How many points of each failure type the summary lists.
const LISTED: usize = 3;

/// What a sweep did, for the lines it ends with.
pub struct Summary {
    pub total: usize,
    pub done: usize,
    pub failed: usize,
    pub elapsed: Duration,
    pub latencies: Vec<Duration>,
    pub jobs: usize,
    /// Calls by GPU (`--gpus`), in its order.
    pub gpus: Vec<(String, usize)>,
    /// The signal that stopped it, and the calls it ended unfinished.
    stopped: Option<Stopped>,
    /// By error type: how many, the first one's message, the first points.
    failures: BTreeMap<String, Failures>,
}

/// A sweep a signal stopped: the signal, and the calls in flight then.
struct Stopped {
    signal: i32,
    /// How many were in flight.
    ended: usize,
    /// The first few: index, kwargs.
    points: Vec<(usize, String)>,
}

/// How many of the points in flight when a sweep was stopped it names.
const LISTED_IN_FLIGHT: usize = 10;

#[derive(Default)]
struct Failures {
    count: usize,
    /// The first few: index, kwargs, message.
    points: Vec<(usize, String, String)>,
}

/// The longest message a summary line shows.
const MESSAGE_CHARS: usize = 120;

impl Summary {
    pub fn new(total: usize, jobs: usize) -> Summary {
        Summary {
            total,
            done: 0,
            failed: 0,
            elapsed: Duration::ZERO,
            latencies: Vec::with_capacity(total.min(1 << 16)),
            jobs,
            gpus: Vec::new(),
            stopped: None,
            failures: BTreeMap::new(),
        }
    }

    /// Stopped by `signal`, with calls `ended` (ascending) in flight, each
    /// call's arguments read from `kwargs`.
    pub fn stopped_by(
        &mut self,
        signal: i32,
        ended: &[usize],
        kwargs: impl Fn(usize) -> Map<String, Value>,
    ) {
        let points = ended
            .iter()
            .take(LISTED_IN_FLIGHT)
            .map(|&index| (index, shorten(Value::Object(kwargs(index)).to_string())))
            .collect();
        self.stopped = Some(Stopped {
            signal,
            ended: ended.len(),
            points,
        });
    }

    pub fn record(&mut self, done: &Done, kwargs: &Map<String, Value>, outcome: Outcome) {
        self.done += 1;
        if let Some((_, calls)) = done.gpu.and_then(|position| self.gpus.get_mut(position)) {
            *calls += 1;
        }
        self.latencies.push(done.duration);
        if outcome.ok {
            return;
        }
        self.failed += 1;
        let failures = self.failures.entry(outcome.kind.clone()).or_default();
        failures.count += 1;
        // The lowest indices, whatever order they ended in.
        if failures.points.len() < LISTED
            || failures.points.last().is_some_and(|p| p.0 > done.index)
        {
            // The type heads the entry already.
            let prefix = format!("{}: ", outcome.kind);
            let message = outcome
                .short
                .strip_prefix(&prefix)
                .unwrap_or(&outcome.short);
            let message = shorten(message.lines().next().unwrap_or("").to_string());
            let kwargs = Value::Object(kwargs.clone()).to_string();
            failures.points.push((done.index, kwargs, message));
            failures.points.sort_by_key(|p| p.0);
            failures.points.truncate(LISTED);
        }
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let seconds = self.elapsed.as_secs_f64();
        let rate = if seconds > 0.0 {
            self.done as f64 / seconds
        } else {
            0.0
        };
        match &self.stopped {
            None => write!(f, "sweep: {} call{}", self.done, plural(self.done))?,
            Some(stopped) => write!(
                f,
                "sweep: stopped by {} after {} of {} calls ({} in flight ended, {} not \
                 started)",
                signal_name(stopped.signal),
                self.done,
                self.total,
                stopped.ended,
                self.total - self.done - stopped.ended
            )?,
        }
        write!(
            f,
            ", {} failed, in {:.2} s: {:.0} calls/s, latency p50 {:.2} ms, p99 {:.2} ms ({} in flight)",
            self.failed,
            seconds,
            rate,
            millis(percentile(&self.latencies, 0.50)),
            millis(percentile(&self.latencies, 0.99)),
            self.jobs.min(self.total.max(1))
        )?;
        if !self.gpus.is_empty() {
            let each: Vec<String> = (self.gpus.iter())
                .map(|(id, calls)| format!("GPU {id} {calls}"))
                .collect();
            write!(f, "\n  calls per GPU: {}", each.join(", "))?;
        }
        if let Some(stopped) = self.stopped.as_ref().filter(|s| !s.points.is_empty()) {
            let points: Vec<String> = stopped
                .points
                .iter()
                .map(|(index, kwargs)| format!("#{index} {kwargs}"))
                .collect();
            write!(f, "\n  in flight when stopped: {}", points.join(", "))?;
            if stopped.ended > stopped.points.len() {
                write!(f, ", … and {} more", stopped.ended - stopped.points.len())?;
            }
        }
        for (kind, failures) in &self.failures {
            write!(f, "\n  {} × {kind}", failures.count)?;
            for (index, kwargs, message) in &failures.points {
                write!(f, "\n      #{index} {kwargs}: {message}")?;
            }
            if failures.count > failures.points.len() {
                write!(
                    f,
                    "\n      … and {} more",
                    failures.count - failures.points.len()
                )?;
            }
        }
        Ok(())
    }
}

/// `text`, cut to [`MESSAGE_CHARS`] characters, an ellipsis its last.
fn shorten(text: String) -> String {
    if text.chars().count() <= MESSAGE_CHARS {
        return text;
    }
    text.chars().take(MESSAGE_CHARS - 1).collect::<String>() + "…"
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

fn signal_name(signal: i32) -> String {
    nix::sys::signal::Signal::try_from(signal)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("signal {signal}"))
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The `q` quantile of `samples` (nearest rank); zero when empty.
pub fn percentile(samples: &[Duration], q: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// The progress bar: done/total, failures, calls/s, ETA, on stderr.
pub fn progress_bar(total: usize) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(total as u64),
        indicatif::ProgressDrawTarget::stderr_with_hz(10),
    );
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30.cyan/blue} {pos}/{len} calls · {msg} · {rate} · ETA {eta}",
        )
        .expect("a valid template")
        .with_key(
            "rate",
            |state: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = write!(w, "{:.0} calls/s", state.per_sec());
            },
        )
        .progress_chars("█▉▊▋▌▍▎▏ "),
    );
    bar.set_message("0 failed");
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_listed_by_type_with_their_first_points() {
        let mut summary = Summary::new(10, 2);
        let kwargs = |x: i64| {
            serde_json::from_value::<Map<String, Value>>(serde_json::json!({"x": x})).unwrap()
        };
        for x in 0..6 {
            let done = Done {
                index: x as usize,
                answer: Default::default(),
                duration: Duration::from_millis(1),
                gpu: None,
            };
            let outcome = Outcome {
                ok: x == 0,
                kind: if x == 5 { "RemoteError" } else { "ValueError" }.into(),
                short: format!("bad {x}"),
            };
            summary.record(&done, &kwargs(x), outcome);
        }
        let text = summary.to_string();
        assert!(text.starts_with("sweep: 6 calls, 5 failed"), "{text}");
        assert!(
            text.contains("\n  1 × RemoteError\n      #5 {\"x\":5}: bad 5"),
            "{text}"
        );
        assert!(
            text.contains(
                "\n  4 × ValueError\n      #1 {\"x\":1}: bad 1\n      #2 {\"x\":2}: bad 2"
            ),
            "{text}"
        );
        assert!(text.contains("… and 1 more"), "{text}");
    }

    #[test]
    fn a_stopped_sweep_names_its_points_in_flight() {
        let kwargs = |x: usize| {
            serde_json::from_value::<Map<String, Value>>(serde_json::json!({"x": x})).unwrap()
        };
        let mut summary = Summary::new(100, 12);
        summary.stopped_by(2, &[12, 13], kwargs);
        let text = summary.to_string();
        assert!(
            text.starts_with(
                "sweep: stopped by SIGINT after 0 of 100 calls (2 in flight ended, 98 not started)"
            ),
            "{text}"
        );
        assert!(
            text.ends_with("\n  in flight when stopped: #12 {\"x\":12}, #13 {\"x\":13}"),
            "{text}"
        );
        let ended: Vec<usize> = (20..32).collect();
        summary.stopped_by(15, &ended, kwargs);
        let text = summary.to_string();
        assert!(
            text.contains("(12 in flight ended, 88 not started)"),
            "{text}"
        );
        assert!(
            text.contains(
                "in flight when stopped: #20 {\"x\":20}, #21 {\"x\":21}, #22 {\"x\":22}, #23 \
                 {\"x\":23}, #24 {\"x\":24}, #25 {\"x\":25}, #26 {\"x\":26}, #27 {\"x\":27}, \
                 #28 {\"x\":28}, #29 {\"x\":29}, … and 2 more"
            ),
            "{text}"
        );
    }
}
