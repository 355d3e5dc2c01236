//! Grid axes for `sweep --grid NAME=VALUES`, and their product.
//!
//! `x=0..999` is every integer from 0 to 999, both ends included (as `seq`
//! counts, since a sweep's ends are usually values someone wants run);
//! `x=0..1:0.25` steps by 0.25; `x=1,2,5` and `opt=adam,sgd` list values.
//! A value is JSON where it parses as JSON (`3`, `0.5`, `true`, `"a b"`),
//! else it is a string.

use serde_json::{Map, Value};

/// The most points a sweep may have: past this, the grid is a typo.
pub const MAX_POINTS: usize = 10_000_000;

/// One axis: a keyword argument and the values it takes.
#[derive(Debug, Clone, PartialEq)]
pub struct Axis {
    pub name: String,
    pub values: Vec<Value>,
}

/// Parses `NAME=VALUES`.
pub fn parse_axis(spec: &str) -> Result<Axis, String> {
    let hint = "expected NAME=VALUES, e.g. x=0..999, x=0..1:0.1 or x=1,2,5";
    let (name, values) = spec
        .split_once('=')
        .ok_or_else(|| format!("--grid {spec}: {hint}"))?;
    let name = name.trim();
    if name.is_empty() || values.trim().is_empty() {
        return Err(format!("--grid {spec}: {hint}"));
    }
    let values = match range(values) {
        Some(range) => range.map_err(|why| format!("--grid {spec}: {why}"))?,
        None => values.split(',').map(|v| scalar(v.trim())).collect(),
    };
    Ok(Axis {
        name: name.to_string(),
        values,
    })
}

/// `a..b` or `a..b:step`, or `None` when `text` is not a range at all.
fn range(text: &str) -> Option<Result<Vec<Value>, String>> {
    let (bounds, step) = match text.split_once(':') {
        Some((bounds, step)) => (bounds, Some(step.trim())),
        None => (text, None),
    };
    let (start, end) = bounds.split_once("..")?;
    let (start, end) = (start.trim(), end.trim());
    Some(numeric_range(start, end, step))
}

fn numeric_range(start: &str, end: &str, step: Option<&str>) -> Result<Vec<Value>, String> {
    let ints = (
        start.parse::<i64>(),
        end.parse::<i64>(),
        step.map(str::parse::<i64>),
    );
    if let (Ok(a), Ok(b), None | Some(Ok(_))) = ints {
        let step = step.map(|s| s.parse::<i64>().unwrap_or(1)).unwrap_or(1);
        if step <= 0 {
            return Err("the step must be positive".into());
        }
        let count = if b < a {
            0
        } else {
            ((b - a) / step + 1) as usize
        };
        if count > MAX_POINTS {
            return Err(format!("{count} values, more than {MAX_POINTS}"));
        }
        return Ok((0..count as i64)
            .map(|i| Value::from(a + i * step))
            .collect());
    }
    let number = |s: &str| {
        s.parse::<f64>()
            .map_err(|_| format!("{s:?} is not a number"))
    };
    let (a, b) = (number(start)?, number(end)?);
    let step = match step {
        Some(step) => number(step)?,
        None => 1.0,
    };
    if step.is_nan() || step <= 0.0 || !a.is_finite() || !b.is_finite() {
        return Err("the bounds must be numbers and the step positive".into());
    }
    // A hair of tolerance, so 0..1:0.1 ends at 1.0 despite binary fractions.
    let count = if b < a {
        0.0
    } else {
        ((b - a) / step + 1e-9).floor() + 1.0
    };
    if count > MAX_POINTS as f64 {
        return Err(format!("{count} values, more than {MAX_POINTS}"));
    }
    Ok((0..count as usize)
        .map(|i| Value::from(a + i as f64 * step))
        .collect())
}

/// A listed value: JSON when it is JSON, else the text itself.
fn scalar(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_string()))
}

/// Every combination of the axes, the first axis slowest, each merged over
/// `base` (an axis wins over a keyword argument of the same name).
pub fn points(axes: &[Axis], base: &Map<String, Value>) -> Result<Vec<Map<String, Value>>, String> {
    let mut seen = std::collections::HashSet::new();
    for axis in axes {
        if !seen.insert(&axis.name) {
            return Err(format!("--grid {} is given twice", axis.name));
        }
    }
    let total = axes
        .iter()
        .try_fold(1usize, |n, axis| n.checked_mul(axis.values.len()))
        .filter(|&n| n <= MAX_POINTS)
        .ok_or_else(|| format!("the grid has more than {MAX_POINTS} points"))?;
    let mut points = Vec::with_capacity(total);
    for index in 0..total {
        let mut point = base.clone();
        let mut rest = index;
        for axis in axes.iter().rev() {
            let len = axis.values.len();
            point.insert(axis.name.clone(), axis.values[rest % len].clone());
            rest /= len;
        }
        points.push(point);
    }
    Ok(points)
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
    }

    #[test]
    fn float_steps_reach_the_end() {
        let axis = parse_axis("lr=0..1:0.25").unwrap();
        assert_eq!(
            axis.values,
            vec![json!(0.0), json!(0.25), json!(0.5), json!(0.75), json!(1.0)]
        );
        assert_eq!(parse_axis("x=0..1:0.1").unwrap().values.len(), 11);
    }

    #[test]
    fn lists_are_json_where_they_parse() {
        let axis = parse_axis("opt=adam,2,0.5,true").unwrap();
        assert_eq!(
            axis.values,
            vec![json!("adam"), json!(2), json!(0.5), json!(true)]
        );
    }

    #[test]
    fn bad_specs_say_what_is_expected() {
        assert!(
            parse_axis("x")
                .unwrap_err()
                .contains("expected NAME=VALUES")
        );
        assert!(parse_axis("x=0..z").unwrap_err().contains("not a number"));
        assert!(parse_axis("x=0..4:0").unwrap_err().contains("positive"));
    }

    #[test]
    fn product_runs_first_axis_slowest() {
        let axes = [parse_axis("a=1,2").unwrap(), parse_axis("b=x,y").unwrap()];
        let base: Map<String, Value> = serde_json::from_value(json!({"c": 0, "a": 9})).unwrap();
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
        assert!(points(&[axes[0].clone(), axes[0].clone()], &Map::new()).is_err());
    }
}
