//! The keyword arguments of `run` and `sweep`: `--kwargs '{…}'`, repeated
//! `-k NAME=VALUE`, and `--input FILE` of one JSON object per line.
//!
//! A `-k` value is JSON where it parses as JSON (`-k n=3` is the int 3,
//! `-k flag=true` a bool), else it is the string itself (`-k opt=adam`).
//! No source silently overrides another: a name given twice is refused.

use std::io::BufRead;
use std::path::Path;

use serde_json::{Map, Value};

pub type Kwargs = Map<String, Value>;

/// `--kwargs JSON` and every `-k NAME=VALUE`, merged.
pub fn fixed(kwargs: Option<&str>, pairs: &[String]) -> Result<Kwargs, String> {
    let mut merged = match kwargs {
        None => Map::new(),
        Some(text) => serde_json::from_str::<Kwargs>(text).map_err(|e| {
            format!("--kwargs must be a JSON object ({e})\nhint: e.g. --kwargs '{{\"seed\": 1}}'")
        })?,
    };
    for pair in pairs {
        let (name, value) = pair_value(pair)?;
        if merged.contains_key(&name) {
            return Err(format!(
                "-k {pair}: {name} is given twice\nhint: give each argument once, with -k or in --kwargs"
            ));
        }
        merged.insert(name, value);
    }
    Ok(merged)
}

/// `NAME=VALUE`: the value as JSON where it parses, else as a string.
pub fn pair_value(pair: &str) -> Result<(String, Value), String> {
    let (name, value) = pair
        .split_once('=')
        .filter(|(name, _)| !name.trim().is_empty())
        .ok_or_else(|| {
            format!("-k {pair}: expected NAME=VALUE, e.g. -k x=1, -k opt=adam or -k 'xs=[1, 2]'")
        })?;
    let value = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_string()));
    Ok((name.trim().to_string(), value))
}

/// The calls of `--input`: one JSON object per line (blank lines skipped),
/// each merged over `base`. `-` is stdin, read to its end first.
pub fn input(path: &Path, base: &Kwargs) -> Result<Vec<Kwargs>, String> {
    let name = path.display().to_string();
    let reader: Box<dyn BufRead> = if name == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        let file =
            std::fs::File::open(path).map_err(|e| format!("cannot read --input {name}: {e}"))?;
        Box::new(std::io::BufReader::new(file))
    };
    let mut calls = Vec::new();
    for (number, line) in reader.lines().enumerate() {
        let number = number + 1;
        let line = line.map_err(|e| format!("cannot read --input {name}: {e}"))?;
        if line.trim().is_empty() {
            continue;
        }
        let kwargs = match serde_json::from_str::<Value>(&line) {
            Ok(Value::Object(kwargs)) => kwargs,
            Ok(other) => {
                return Err(format!(
                    "--input {name} line {number}: expected a JSON object of keyword arguments, \
                     got {}\nhint: one object per line, e.g. {{\"x\": 1, \"opt\": \"adam\"}}",
                    kind(&other)
                ));
            }
            Err(error) => {
                return Err(format!(
                    "--input {name} line {number} is not JSON: {error}\nhint: one object per \
                     line, e.g. {{\"x\": 1, \"opt\": \"adam\"}}"
                ));
            }
        };
        let mut call = base.clone();
        for (key, value) in kwargs {
            if call.contains_key(&key) {
                return Err(format!(
                    "--input {name} line {number} sets {key}, which --kwargs or -k sets too\n\
                     hint: give it in one place"
                ));
            }
            call.insert(key, value);
        }
        calls.push(call);
    }
    if calls.is_empty() {
        return Err(format!(
            "--input {name} has no calls: expected one JSON object per line"
        ));
    }
    Ok(calls)
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pairs_are_json_where_they_parse() {
        let merged = fixed(
            Some(r#"{"seed": 1}"#),
            &[
                "x=1".into(),
                "opt=adam".into(),
                "xs=[1, 2]".into(),
                "empty=".into(),
                "s=\"7\"".into(),
            ],
        )
        .unwrap();
        assert_eq!(
            Value::Object(merged),
            json!({"seed": 1, "x": 1, "opt": "adam", "xs": [1, 2], "empty": "", "s": "7"})
        );
    }

    #[test]
    fn a_name_given_twice_is_refused() {
        assert!(
            fixed(Some(r#"{"x": 1}"#), &["x=2".into()])
                .unwrap_err()
                .contains("given twice")
        );
        assert!(
            fixed(None, &["x=1".into(), "x=2".into()])
                .unwrap_err()
                .contains("given twice")
        );
        assert!(
            fixed(None, &["=1".into()])
                .unwrap_err()
                .contains("NAME=VALUE")
        );
        assert!(fixed(Some("[1]"), &[]).unwrap_err().contains("JSON object"));
    }
}
