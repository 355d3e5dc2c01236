//! The node function's parameters, checked against the calls before any is
//! forked: a grid axis the function does not take fails once, with the
//! names it does take, rather than in each of a thousand children.

use pyo3::prelude::*;
use serde_json::{Map, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    PositionalOnly,
    Normal,
    VarPositional,
    KeywordOnly,
    VarKeyword,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    pub name: String,
    pub kind: Kind,
    pub has_default: bool,
}

/// The function's name and parameters, as `inspect.signature` reads them;
/// `None` where it cannot (a builtin, a callable without a signature).
pub fn read(py: Python<'_>, function: &Bound<'_, PyAny>) -> Option<(String, Vec<Param>)> {
    let inspect = py.import("inspect").ok()?;
    let signature = inspect.call_method1("signature", (function,)).ok()?;
    let empty = inspect.getattr("Parameter").ok()?.getattr("empty").ok()?;
    let mut params = Vec::new();
    for param in signature
        .getattr("parameters")
        .ok()?
        .call_method0("values")
        .ok()?
        .try_iter()
        .ok()?
    {
        let param = param.ok()?;
        let kind = match param
            .getattr("kind")
            .ok()?
            .getattr("name")
            .ok()?
            .extract::<String>()
            .ok()?
            .as_str()
        {
            "POSITIONAL_ONLY" => Kind::PositionalOnly,
            "POSITIONAL_OR_KEYWORD" => Kind::Normal,
            "VAR_POSITIONAL" => Kind::VarPositional,
            "KEYWORD_ONLY" => Kind::KeywordOnly,
            "VAR_KEYWORD" => Kind::VarKeyword,
            _ => return None,
        };
        params.push(Param {
            name: param.getattr("name").ok()?.extract().ok()?,
            kind,
            has_default: !param.getattr("default").ok()?.is(&empty),
        });
    }
    let name = function
        .getattr("__name__")
        .ok()
        .and_then(|n| n.extract::<String>().ok())
        .unwrap_or_else(|| "process".into());
    Some((name, params))
}

/// Refuses calls the function cannot take: a name it has no parameter for
/// (unless it takes `**kwargs`), or a required parameter a call lacks.
/// `describe(i)` says where call `i` came from, for the message.
pub fn check(
    function: &str,
    params: &[Param],
    calls: &[Map<String, Value>],
    describe: &dyn Fn(usize) -> String,
) -> Result<(), String> {
    let takes = |name: &str| {
        params
            .iter()
            .any(|p| p.name == name && matches!(p.kind, Kind::Normal | Kind::KeywordOnly))
    };
    let open = params.iter().any(|p| p.kind == Kind::VarKeyword);
    let named: Vec<&str> = params
        .iter()
        .filter(|p| matches!(p.kind, Kind::Normal | Kind::KeywordOnly))
        .map(|p| p.name.as_str())
        .collect();
    let takes_list = if named.is_empty() {
        "it takes no keyword arguments".to_string()
    } else {
        format!("it takes {}", named.join(", "))
    };
    let required: Vec<&Param> = params
        .iter()
        .filter(|p| {
            !p.has_default
                && matches!(
                    p.kind,
                    Kind::Normal | Kind::KeywordOnly | Kind::PositionalOnly
                )
        })
        .collect();
    for (index, call) in calls.iter().enumerate() {
        if !open && let Some(name) = call.keys().find(|name| !takes(name)) {
            return Err(format!(
                "{function}() takes no argument named {name} ({})\nhint: {takes_list}; rename \
                 it, or give {function} a **kwargs parameter",
                describe(index)
            ));
        }
        if let Some(param) = required.iter().find(|p| p.kind == Kind::PositionalOnly) {
            return Err(format!(
                "{function}() takes {} positionally only, and a node is called with keyword \
                 arguments\nhint: drop the / from its parameters",
                param.name
            ));
        }
        if let Some(param) = required.iter().find(|p| !call.contains_key(&p.name)) {
            return Err(format!(
                "{function}() needs {0}, which {1} does not give\nhint: add it with --grid \
                 {0}=…, -k {0}=… or --kwargs, or give it a default",
                param.name,
                describe(index)
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn param(name: &str, kind: Kind, has_default: bool) -> Param {
        Param {
            name: name.into(),
            kind,
            has_default,
        }
    }

    fn calls(values: Value) -> Vec<Map<String, Value>> {
        serde_json::from_value(values).unwrap()
    }

    #[test]
    fn unknown_and_missing_names_are_refused_once() {
        let params = [
            param("x", Kind::Normal, false),
            param("offset", Kind::Normal, true),
        ];
        let describe = |i: usize| format!("call {i}");
        assert!(
            check(
                "process",
                &params,
                &calls(json!([{"x": 1}, {"x": 2, "offset": 1}])),
                &describe
            )
            .is_ok()
        );
        let error = check(
            "process",
            &params,
            &calls(json!([{"x": 1, "z": 2}])),
            &describe,
        )
        .unwrap_err();
        assert!(
            error.contains("takes no argument named z") && error.contains("it takes x, offset"),
            "{error}"
        );
        let error = check(
            "process",
            &params,
            &calls(json!([{"x": 1}, {"offset": 2}])),
            &describe,
        )
        .unwrap_err();
        assert!(
            error.contains("needs x, which call 1 does not give"),
            "{error}"
        );
    }

    #[test]
    fn var_keyword_takes_any_name() {
        let params = [
            param("x", Kind::Normal, false),
            param("rest", Kind::VarKeyword, false),
        ];
        assert!(
            check("f", &params, &calls(json!([{"x": 1, "z": 2}])), &|_| {
                String::new()
            })
            .is_ok()
        );
        let only = [
            param("x", Kind::PositionalOnly, true),
            param("args", Kind::VarPositional, false),
        ];
        assert!(check("f", &only, &calls(json!([{"x": 1}])), &|_| String::new()).is_err());
    }
}
