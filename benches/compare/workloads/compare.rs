//! Are two rows' results the same? Each row's output, read back by point
//! index (ours writes in completion order, the baselines in index order),
//! compared value by value.
//!
//! Floats are equal within a relative 1e-9: a row's BLAS may run on another
//! number of threads (joblib's workers get one each, a for-loop every
//! core), which reorders a sum and moves its last bits. Everything else
//! (keys, strings, integers, the number of points) must match exactly.

use serde_json::Value;

/// How close two floats must be, relative to the larger.
pub const RELATIVE_TOLERANCE: f64 = 1e-9;

/// A row's output: each point's result by index (`None`: no line for it),
/// and the per-point seconds the for-loop measured in process.
#[derive(Debug, Clone, Default)]
pub struct Output {
    pub results: Vec<Option<Value>>,
    pub seconds: Vec<f64>,
}

impl Output {
    /// The median of a point's own time, in ms, where the row measured it.
    pub fn point_ms(&self) -> Option<f64> {
        let mut seconds = self.seconds.clone();
        seconds.sort_by(f64::total_cmp);
        let mid = seconds.len() / 2;
        match seconds.len() {
            0 => None,
            n if n % 2 == 1 => Some(seconds[mid] * 1e3),
            _ => Some((seconds[mid - 1] + seconds[mid]) / 2.0 * 1e3),
        }
    }
}

/// Reads an output of `n` points: one JSON object a line with `index` and
/// `result` (ours also `ok`; the for-loop also `seconds`). A failed point,
/// an index out of range or given twice, a line that is not JSON: the row's
/// output cannot be trusted, and the error says where.
pub fn parse(text: &str, n: usize) -> Result<Output, String> {
    let mut output = Output {
        results: vec![None; n],
        seconds: Vec::new(),
    };
    for (number, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("output line {}", number + 1);
        let mut object: serde_json::Map<String, Value> =
            serde_json::from_str(line).map_err(|e| format!("{}: not a JSON object ({e})", at()))?;
        let index = object
            .get("index")
            .and_then(Value::as_u64)
            .ok_or_else(|| format!("{}: no index", at()))? as usize;
        if object.get("ok").and_then(Value::as_bool) == Some(false) {
            let error = object
                .get("error")
                .and_then(|e| e.get("short").or_else(|| e.get("message")))
                .and_then(Value::as_str)
                .unwrap_or("failed");
            return Err(format!("point #{index} failed: {error}"));
        }
        let result = object
            .remove("result")
            .ok_or_else(|| format!("{}: no result", at()))?;
        let slot = output
            .results
            .get_mut(index)
            .ok_or_else(|| format!("{}: index {index} of {n} points", at()))?;
        if slot.replace(result).is_some() {
            return Err(format!("{}: index {index} twice", at()));
        }
        if let Some(seconds) = object.get("seconds").and_then(Value::as_f64) {
            output.seconds.push(seconds);
        }
    }
    Ok(output)
}

/// Where `theirs` first differs from `reference`, point by point, in index
/// order: `None` when every point's result is the same.
pub fn first_difference(reference: &[Option<Value>], theirs: &[Option<Value>]) -> Option<String> {
    if reference.len() != theirs.len() {
        return Some(format!(
            "{} points against {}",
            theirs.len(),
            reference.len()
        ));
    }
    reference
        .iter()
        .zip(theirs)
        .enumerate()
        .find_map(|(index, pair)| match pair {
            (None, None) => None,
            (Some(_), None) => Some(format!("index {index}: no result")),
            (None, Some(_)) => Some(format!("index {index}: a result the reference lacks")),
            (Some(a), Some(b)) => {
                difference(a, b, "result").map(|at| format!("index {index}: {at}"))
            }
        })
}

/// Where two values differ, as a path from `path`: `result["accuracy"] is
/// 0.94 against 0.95`.
fn difference(reference: &Value, theirs: &Value, path: &str) -> Option<String> {
    match (reference, theirs) {
        (Value::Number(a), Value::Number(b)) => {
            (!numbers_equal(a, b)).then(|| format!("{path} is {b} against {a}"))
        }
        (Value::Array(a), Value::Array(b)) => {
            if a.len() != b.len() {
                return Some(format!("{path} has {} items against {}", b.len(), a.len()));
            }
            a.iter()
                .zip(b)
                .enumerate()
                .find_map(|(i, (a, b))| difference(a, b, &format!("{path}[{i}]")))
        }
        (Value::Object(a), Value::Object(b)) => {
            if let Some(key) = a.keys().find(|k| !b.contains_key(*k)) {
                return Some(format!("{path} has no {key:?}"));
            }
            if let Some(key) = b.keys().find(|k| !a.contains_key(*k)) {
                return Some(format!("{path} has {key:?}, which the reference has not"));
            }
            a.iter()
                .find_map(|(key, a)| difference(a, &b[key], &format!("{path}[{key:?}]")))
        }
        (a, b) => (a != b).then(|| format!("{path} is {b} against {a}")),
    }
}

/// Integers exactly, anything else as floats within the tolerance.
fn numbers_equal(a: &serde_json::Number, b: &serde_json::Number) -> bool {
    if a == b {
        return true;
    }
    let integer =
        |n: &serde_json::Number| n.as_i64().map(i128::from).or(n.as_u64().map(i128::from));
    if let (Some(a), Some(b)) = (integer(a), integer(b)) {
        return a == b;
    }
    match (a.as_f64(), b.as_f64()) {
        (Some(a), Some(b)) => a == b || (a - b).abs() <= RELATIVE_TOLERANCE * a.abs().max(b.abs()),
        _ => false,
    }
}

// Run by tests/bench_units.rs. Cargo sets cfg(test) for every bench and
// test, so the benches compile this too, without its #[test] functions.
#[cfg(test)]
#[allow(unused_imports, dead_code)]
mod tests {
    use super::*;

    fn output(text: &str, n: usize) -> Vec<Option<Value>> {
        parse(text, n).expect("parses").results
    }

    #[test]
    fn completion_order_and_index_order_read_the_same() {
        let ours = "{\"index\": 1, \"kwargs\": {}, \"ok\": true, \"result\": {\"a\": 2.5}}\n\
                    {\"index\": 0, \"kwargs\": {}, \"ok\": true, \"result\": {\"a\": 1}}\n";
        let loop_ = "{\"index\": 0, \"result\": {\"a\": 1}, \"seconds\": 0.002}\n\
                     {\"index\": 1, \"result\": {\"a\": 2.5000000000001}, \"seconds\": 0.004}\n";
        assert_eq!(first_difference(&output(loop_, 2), &output(ours, 2)), None);
        assert_eq!(parse(loop_, 2).unwrap().point_ms(), Some(3.0));
    }

    #[test]
    fn the_first_difference_is_named() {
        let a = output("{\"index\": 0, \"result\": {\"a\": 1.0, \"n\": 3}}\n", 2);
        let b = output("{\"index\": 0, \"result\": {\"a\": 1.001, \"n\": 3}}\n", 2);
        assert_eq!(
            first_difference(&a, &b).as_deref(),
            Some("index 0: result[\"a\"] is 1.001 against 1.0")
        );
        let c = output("{\"index\": 0, \"result\": {\"a\": 1.0, \"n\": 4}}\n", 2);
        assert_eq!(
            first_difference(&a, &c).as_deref(),
            Some("index 0: result[\"n\"] is 4 against 3")
        );
        let d = output("{\"index\": 1, \"result\": {\"a\": 1.0, \"n\": 3}}\n", 2);
        assert_eq!(
            first_difference(&a, &d).as_deref(),
            Some("index 0: no result")
        );
        let e = output(
            "{\"index\": 0, \"result\": {\"a\": 1.0, \"n\": \"3\"}}\n",
            2,
        );
        assert!(first_difference(&a, &e).is_some());
        assert_eq!(first_difference(&a, &a), None);
    }

    #[test]
    fn an_untrustworthy_output_is_an_error() {
        assert!(parse("{\"index\": 5, \"result\": 1}\n", 2).is_err());
        assert!(
            parse(
                "{\"index\": 0, \"result\": 1}\n{\"index\": 0, \"result\": 1}\n",
                2
            )
            .is_err()
        );
        assert!(parse("not json\n", 2).is_err());
        let failed =
            "{\"index\": 3, \"ok\": false, \"error\": {\"short\": \"ValueError: x (line 6)\"}}\n";
        assert_eq!(
            parse(failed, 4).unwrap_err(),
            "point #3 failed: ValueError: x (line 6)"
        );
    }
}
