//! Grid axes for `sweep --grid NAME=VALUES`, and their product.
//!
//! `x=0..999` is every integer from 0 to 999, both ends included (as `seq`
//! counts, since a sweep's ends are usually values someone wants run);
//! `x=0..1:0.25` steps by 0.25, each value rounded to the decimals the
//! bounds and step are written with (0.1 + 0.2 is 0.3 here); `x=1,2,5` and
//! `opt=adam,sgd` list values; `x=[1,2,[3,4]]` is a JSON list. A listed
//! value is JSON where it parses as JSON (`3`, `0.5`, `true`, `"a b"`), else
//! it is a string.
//!
//! Every spec that would quietly run something other than what was meant
//! (an empty range, a half-parsed list, `0-9` for `0..9`) is refused with
//! what to write instead.

use serde_json::{Map, Value};

/// The most points a sweep may have: past this, the grid is a typo.
pub const MAX_POINTS: usize = 10_000_000;

/// One axis: a keyword argument and the values it takes.
#[derive(Debug, Clone, PartialEq)]
pub struct Axis {
    pub name: String,
    pub values: Vec<Value>,
}

const FORMS: &str = "x=0..999, x=0..1:0.1, x=1,2,5, opt=adam,sgd or x=[1,[2,3]]";

/// Parses `NAME=VALUES`.
pub fn parse_axis(spec: &str) -> Result<Axis, String> {
    let refuse = |why: String| format!("--grid {spec}: {why}");
    let (name, values) = spec
        .split_once('=')
        .ok_or_else(|| refuse(format!("expected NAME=VALUES, e.g. {FORMS}")))?;
    let (name, values) = (name.trim(), values.trim());
    if name.is_empty() || values.is_empty() {
        return Err(refuse(format!("expected NAME=VALUES, e.g. {FORMS}")));
    }
    let values = if values.starts_with('[') {
        json_list(values).map_err(refuse)?
    } else if let Some(range) = range(values) {
        range.map_err(refuse)?
    } else {
        values
            .split(',')
            .map(|v| listed(v.trim()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(refuse)?
    };
    Ok(Axis {
        name: name.to_string(),
        values,
    })
}

/// `[1, "a", [2, 3]]`: its elements are the values.
fn json_list(text: &str) -> Result<Vec<Value>, String> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Array(values)) if !values.is_empty() => Ok(values),
        Ok(Value::Array(_)) => Err("the list is empty: an axis needs a value".into()),
        Ok(_) => Err("expected a JSON list".into()),
        Err(error) => Err(format!(
            "not a JSON list ({error})\nhint: quote it for the shell, e.g. --grid 'x=[1, 2, \"a b\"]'"
        )),
    }
}

/// `a..b` or `a..b:step`, or `None` when `text` is not a range at all.
fn range(text: &str) -> Option<Result<Vec<Value>, String>> {
    let (bounds, step) = match text.split_once(':') {
        Some((bounds, step)) => (bounds, Some(step.trim())),
        None => (text, None),
    };
    let (start, end) = bounds.split_once("..")?;
    Some(numeric_range(start.trim(), end.trim(), step))
}

fn numeric_range(start: &str, end: &str, step: Option<&str>) -> Result<Vec<Value>, String> {
    let number = |s: &str| {
        s.parse::<f64>()
            .ok()
            .filter(|n| n.is_finite())
            .ok_or_else(|| {
                format!("{s:?} is not a number; a range is START..END or START..END:STEP")
            })
    };
    let (a, b) = (number(start)?, number(end)?);
    let step_value = match step {
        Some(step) => number(step)?,
        None => 1.0,
    };
    if step_value <= 0.0 {
        return Err(format!(
            "the step must be positive, not {}\nhint: a range counts up; list the values to go down, e.g. x=3,2,1",
            step.unwrap_or("1")
        ));
    }
    if b < a {
        return Err(format!(
            "the range is empty: it counts up from {start}, and {end} is below it\nhint: write \
             {end}..{start}, or list the values in the order wanted, e.g. x=3,2,1"
        ));
    }
    let ints = (
        start.parse::<i64>(),
        end.parse::<i64>(),
        step.map_or(Ok(1), str::parse::<i64>),
    );
    if let (Ok(a), Ok(b), Ok(step)) = ints {
        let count = ((b - a) / step + 1) as usize;
        if count > MAX_POINTS {
            return Err(format!("{count} values, more than {MAX_POINTS}"));
        }
        return Ok((0..count as i64)
            .map(|i| Value::from(a + i * step))
            .collect());
    }
    // A hair of tolerance, so 0..1:0.1 ends at 1.0 despite binary fractions.
    let count = ((b - a) / step_value + 1e-9).floor() + 1.0;
    if count > MAX_POINTS as f64 {
        return Err(format!("{count} values, more than {MAX_POINTS}"));
    }
    let decimals = [start, end, step.unwrap_or("1")]
        .iter()
        .map(|s| decimals(s))
        .max()
        .unwrap_or(0);
    Ok((0..count as usize)
        .map(|i| Value::from(round(a + i as f64 * step_value, decimals)))
        .collect())
}

/// Digits after the point as written (`0.25` has 2; `1e-3` counts 3).
fn decimals(text: &str) -> usize {
    let (mantissa, exponent) = match text.split_once(['e', 'E']) {
        Some((m, e)) => (m, e.parse::<i64>().unwrap_or(0)),
        None => (text, 0),
    };
    let fraction = mantissa.split_once('.').map_or(0, |(_, f)| f.len()) as i64;
    (fraction - exponent).clamp(0, 15) as usize
}

fn round(value: f64, decimals: usize) -> f64 {
    format!("{value:.decimals$}").parse().unwrap_or(value)
}

/// A listed value: JSON when it is JSON, else the text itself; refused
/// where it looks like a range written another way.
fn listed(text: &str) -> Result<Value, String> {
    if text.is_empty() {
        return Err("an empty value in the list\nhint: write \"\" for an empty string".into());
    }
    if let Some((a, b)) = text
        .split_once('-')
        .filter(|(a, b)| !a.is_empty() && a.parse::<f64>().is_ok() && b.parse::<f64>().is_ok())
    {
        return Err(format!(
            "{text} is not a range (a range is {a}..{b})\nhint: write {a}..{b}, or '\"{text}\"' \
             for the string"
        ));
    }
    if text.starts_with('[') || text.ends_with(']') {
        return Err(format!(
            "{text} is part of a list split at its commas\nhint: give the whole axis as one JSON \
             list, e.g. --grid 'x=[1, 2, 3]'"
        ));
    }
    Ok(serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_string())))
}

/// Every combination of the axes, the first axis slowest, each merged over
/// `base`: made one point at a time, so a grid of millions costs nothing
/// until its calls run.
#[derive(Debug, Clone)]
pub struct Grid {
    axes: Vec<Axis>,
    base: Map<String, Value>,
    len: usize,
}

impl Grid {
    /// An axis may not name an argument `base` already gives: which one
    /// should win is a guess, so neither does.
    pub fn new(axes: Vec<Axis>, base: Map<String, Value>) -> Result<Grid, String> {
        let mut seen = std::collections::HashSet::new();
        for axis in &axes {
            if !seen.insert(&axis.name) {
                return Err(format!(
                    "--grid {} is given twice\nhint: give every value in one axis, e.g. --grid {}=1,2,3",
                    axis.name, axis.name
                ));
            }
            if base.contains_key(&axis.name) {
                return Err(format!(
                    "--grid {0} and the fixed arguments (--kwargs or -k) both set {0}\nhint: give \
                     it in one place: as an axis to sweep it, as a fixed argument to keep it the same",
                    axis.name
                ));
            }
        }
        let len = axes
            .iter()
            .try_fold(1usize, |n, axis| n.checked_mul(axis.values.len()))
            .filter(|&n| n <= MAX_POINTS)
            .ok_or_else(|| format!("the grid has more than {MAX_POINTS} points"))?;
        Ok(Grid { axes, base, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Point `index` (below [`Grid::len`]).
    pub fn point(&self, index: usize) -> Map<String, Value> {
        let mut point = self.base.clone();
        let mut rest = index;
        for axis in self.axes.iter().rev() {
            let len = axis.values.len();
            point.insert(axis.name.clone(), axis.values[rest % len].clone());
            rest /= len;
        }
        point
    }
}

/// Every point of `axes` over `base`, at once (for small grids and tests).
pub fn points(axes: &[Axis], base: &Map<String, Value>) -> Result<Vec<Map<String, Value>>, String> {
    let grid = Grid::new(axes.to_vec(), base.clone())?;
    Ok((0..grid.len()).map(|i| grid.point(i)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn integer_range_includes_both_ends() {
        let axis = parse_axis("x=0..999").unwrap();
        assert_eq!(axis.values.len(), 1000);
        assert_eq!(axis.values[999], json!(999));
        assert_eq!(
            parse_axis("x=0..10:5").unwrap().values,
            vec![json!(0), json!(5), json!(10)]
        );
        assert_eq!(parse_axis("x=3..3").unwrap().values, vec![json!(3)]);
    }

    #[test]
    fn float_steps_reach_the_end_rounded_to_their_decimals() {
        let axis = parse_axis("lr=0..1:0.25").unwrap();
        assert_eq!(
            axis.values,
            vec![json!(0.0), json!(0.25), json!(0.5), json!(0.75), json!(1.0)]
        );
        let tenths = parse_axis("x=0..1:0.1").unwrap().values;
        assert_eq!(tenths.len(), 11);
        assert_eq!(tenths[3], json!(0.3));
        assert_eq!(tenths[7], json!(0.7));
        assert_eq!(
            parse_axis("x=0.5..0.8:0.1").unwrap().values,
            vec![json!(0.5), json!(0.6), json!(0.7), json!(0.8)]
        );
        assert_eq!(
            parse_axis("x=0..0.003:1e-3").unwrap().values[3],
            json!(0.003)
        );
    }

    #[test]
    fn lists_are_json_where_they_parse() {
        let axis = parse_axis("opt=adam,2,0.5,true").unwrap();
        assert_eq!(
            axis.values,
            vec![json!("adam"), json!(2), json!(0.5), json!(true)]
        );
        assert_eq!(
            parse_axis("d=2024-01-01").unwrap().values,
            vec![json!("2024-01-01")]
        );
    }

    #[test]
    fn json_lists_are_lists() {
        assert_eq!(
            parse_axis("x=[1,2,3]").unwrap().values,
            vec![json!(1), json!(2), json!(3)]
        );
        assert_eq!(
            parse_axis(r#"x=[[1, 2], "a,b", {"k": 1}]"#).unwrap().values,
            vec![json!([1, 2]), json!("a,b"), json!({"k": 1})]
        );
        assert!(
            parse_axis("x=[1,2")
                .unwrap_err()
                .contains("not a JSON list")
        );
        assert!(parse_axis("x=[]").unwrap_err().contains("empty"));
    }

    #[test]
    fn bad_specs_say_what_is_expected() {
        let expected = |spec: &str, words: &[&str]| {
            let error = parse_axis(spec).unwrap_err();
            for word in words {
                assert!(error.contains(word), "{spec}: {error}");
            }
        };
        expected("x", &["expected NAME=VALUES"]);
        expected("x=0..z", &["not a number"]);
        expected("x=0..4:0", &["positive"]);
        expected("x=0..4:-1", &["positive"]);
        expected("x=10..1", &["empty", "hint: write 1..10"]);
        expected("x=0.5..0.1:0.1", &["empty"]);
        expected("x=0-9", &["not a range", "0..9", "hint:"]);
        expected("x=1,3-5", &["not a range", "3..5"]);
        expected("x=1,,2", &["empty value"]);
        expected("x=1]", &["JSON list"]);
    }

    #[test]
    fn product_runs_first_axis_slowest() {
        let axes = [parse_axis("a=1,2").unwrap(), parse_axis("b=x,y").unwrap()];
        let base: Map<String, Value> = serde_json::from_value(json!({"c": 0})).unwrap();
        let product = points(&axes, &base).unwrap();
        let got: Vec<_> = product
            .iter()
            .map(|p| (p["a"].clone(), p["b"].clone(), p["c"].clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                (json!(1), json!("x"), json!(0)),
                (json!(1), json!("y"), json!(0)),
                (json!(2), json!("x"), json!(0)),
                (json!(2), json!("y"), json!(0)),
            ]
        );
        assert!(
            points(&[axes[0].clone(), axes[0].clone()], &Map::new())
                .unwrap_err()
                .contains("twice")
        );
    }

    #[test]
    fn an_axis_may_not_override_a_fixed_argument() {
        let base: Map<String, Value> = serde_json::from_value(json!({"a": 9})).unwrap();
        let error = points(&[parse_axis("a=1,2").unwrap()], &base).unwrap_err();
        assert!(
            error.contains("both set a") && error.contains("hint:"),
            "{error}"
        );
    }
}
