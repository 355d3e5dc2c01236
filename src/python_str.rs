//! Python's `str()` of a JSON value, as the references take text off a
//! request: `str(request.get("call_id") or "")`, `str(v)` of an `env`
//! value. Rendered from the JSON text itself (not a `serde_json::Value`): a
//! big int keeps its digits, a lone surrogate is kept, a float is written
//! as Python's `repr` writes it.

use serde_json::value::RawValue;

use crate::nesting::{MAX_NESTING, nested_deeper_than};

/// `str(value or "")` of the value `json.loads` reads from `raw`, as the
/// references take a `call_id`: `""` for a falsy value (or none), a
/// string as itself, anything else as Python shows it (`True`, `1e+16`,
/// `[1, 'a', None]`).
///
/// Where a `String` cannot hold what Python would: a lone surrogate in a
/// string shows as U+FFFD (inside a list or dict it is escaped, exactly).
/// Not covered: code points Python's Unicode tables call unassigned
/// (other than planes 4 to 13, wholly unassigned) show as themselves in a
/// list's or dict's repr, where Python escapes them; an int of more than
/// 4,300 digits shows in full, where Python refuses to read it. A value
/// nested deeper than a request may be (it is refused anyway) gives `""`.
pub fn python_str_or_empty(raw: Option<&RawValue>) -> String {
    match raw.and_then(|raw| PyValue::read(raw.get())) {
        Some(PyValue::Str(units)) => String::from_utf16_lossy(&units),
        Some(value) if value.truthy() => {
            let mut shown = String::new();
            value.repr(&mut shown);
            shown
        }
        _ => String::new(),
    }
}

/// `str(value)` of the value `json.loads` reads from `raw`, as agent.py
/// takes an `env` value or an `argv` part: a string as itself, anything
/// else as Python shows it (`True`, `0`, `None`, `1.5`).
pub fn python_str(raw: &RawValue) -> String {
    match PyValue::read(raw.get()) {
        Some(PyValue::Str(units)) => String::from_utf16_lossy(&units),
        Some(value) => {
            let mut shown = String::new();
            value.repr(&mut shown);
            shown
        }
        None => raw.get().to_string(),
    }
}

/// Python's truth of the value `json.loads` reads from `raw`.
pub fn python_truth(raw: &RawValue) -> bool {
    PyValue::read(raw.get()).is_none_or(|value| value.truthy())
}

/// A JSON value as `json.loads` decodes it, kept as far as `str()`, `repr()`
/// and truth need it.
enum PyValue<'a> {
    None,
    Bool(bool),
    /// The JSON digits, sign and all: a Python int has no size limit.
    Int(&'a str),
    /// A number with a fraction or an exponent (`1.0`, `1E2`) is a float.
    Float(f64),
    /// UTF-16, as JSON escapes it: a lone surrogate is kept.
    Str(Vec<u16>),
    List(Vec<PyValue<'a>>),
    /// In the order keys first came, a repeated key's last value winning,
    /// as a dict built from the pairs has it.
    Dict(Vec<(Vec<u16>, PyValue<'a>)>),
}

impl<'a> PyValue<'a> {
    /// `None` where `text` is not one JSON value, or nests deeper than a
    /// request may (which also bounds the recursion here).
    fn read(text: &'a str) -> Option<PyValue<'a>> {
        if nested_deeper_than(text.as_bytes(), MAX_NESTING - 1) {
            return None;
        }
        let mut reader = JsonReader { text, at: 0 };
        let value = reader.value()?;
        reader.skip_space();
        (reader.at == text.len()).then_some(value)
    }

    fn truthy(&self) -> bool {
        match self {
            PyValue::None => false,
            PyValue::Bool(b) => *b,
            PyValue::Int(digits) => digits.trim_start_matches('-') != "0",
            PyValue::Float(f) => *f != 0.0,
            PyValue::Str(units) => !units.is_empty(),
            PyValue::List(items) => !items.is_empty(),
            PyValue::Dict(pairs) => !pairs.is_empty(),
        }
    }

    /// Python's `repr()`, which is `str()` for all but a string.
    fn repr(&self, out: &mut String) {
        match self {
            PyValue::None => out.push_str("None"),
            PyValue::Bool(true) => out.push_str("True"),
            PyValue::Bool(false) => out.push_str("False"),
            // `-0` is the int 0.
            PyValue::Int(_) if !self.truthy() => out.push('0'),
            PyValue::Int(digits) => out.push_str(digits),
            PyValue::Float(f) => float_repr(*f, out),
            PyValue::Str(units) => str_repr(units, out),
            PyValue::List(items) => {
                out.push('[');
                for (n, item) in items.iter().enumerate() {
                    if n > 0 {
                        out.push_str(", ");
                    }
                    item.repr(out);
                }
                out.push(']');
            }
            PyValue::Dict(pairs) => {
                out.push('{');
                for (n, (key, value)) in pairs.iter().enumerate() {
                    if n > 0 {
                        out.push_str(", ");
                    }
                    str_repr(key, out);
                    out.push_str(": ");
                    value.repr(out);
                }
                out.push('}');
            }
        }
    }
}

/// Reads JSON text serde_json has already checked; anything else it
/// answers with `None` rather than guessing.
struct JsonReader<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> JsonReader<'a> {
    fn skip_space(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.text.as_bytes().get(self.at) {
            self.at += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> bool {
        self.skip_space();
        let found = self.text.as_bytes().get(self.at) == Some(&byte);
        if found {
            self.at += 1;
        }
        found
    }

    fn value(&mut self) -> Option<PyValue<'a>> {
        self.skip_space();
        let rest = &self.text[self.at..];
        for (word, value) in [
            ("null", PyValue::None),
            ("true", PyValue::Bool(true)),
            ("false", PyValue::Bool(false)),
        ] {
            if rest.starts_with(word) {
                self.at += word.len();
                return Some(value);
            }
        }
        match *rest.as_bytes().first()? {
            b'"' => self.string().map(PyValue::Str),
            b'[' => {
                self.at += 1;
                let mut items = Vec::new();
                if self.eat(b']') {
                    return Some(PyValue::List(items));
                }
                loop {
                    items.push(self.value()?);
                    if self.eat(b']') {
                        return Some(PyValue::List(items));
                    }
                    if !self.eat(b',') {
                        return None;
                    }
                }
            }
            b'{' => {
                self.at += 1;
                let mut pairs: Vec<(Vec<u16>, PyValue<'a>)> = Vec::new();
                let mut places: std::collections::HashMap<Vec<u16>, usize> =
                    std::collections::HashMap::new();
                if self.eat(b'}') {
                    return Some(PyValue::Dict(pairs));
                }
                loop {
                    self.skip_space();
                    let key = self.string()?;
                    if !self.eat(b':') {
                        return None;
                    }
                    let value = self.value()?;
                    match places.get(&key) {
                        Some(&place) => pairs[place].1 = value,
                        None => {
                            places.insert(key.clone(), pairs.len());
                            pairs.push((key, value));
                        }
                    }
                    if self.eat(b'}') {
                        return Some(PyValue::Dict(pairs));
                    }
                    if !self.eat(b',') {
                        return None;
                    }
                }
            }
            b'-' | b'0'..=b'9' => {
                let length = rest
                    .bytes()
                    .position(|b| !matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'))
                    .unwrap_or(rest.len());
                let number = &rest[..length];
                self.at += length;
                if number.contains(['.', 'e', 'E']) {
                    // Rust's parse rounds as Python's `float()` does, to
                    // infinity past the largest float.
                    number.parse().ok().map(PyValue::Float)
                } else {
                    Some(PyValue::Int(number))
                }
            }
            _ => None,
        }
    }

    /// A string at `at`, its escapes undone, as UTF-16 units.
    fn string(&mut self) -> Option<Vec<u16>> {
        let bytes = self.text.as_bytes();
        if bytes.get(self.at) != Some(&b'"') {
            return None;
        }
        self.at += 1;
        let mut units = Vec::new();
        loop {
            let plain = bytes[self.at..]
                .iter()
                .position(|b| matches!(b, b'"' | b'\\'))?;
            units.extend(self.text[self.at..self.at + plain].encode_utf16());
            self.at += plain;
            if bytes[self.at] == b'"' {
                self.at += 1;
                return Some(units);
            }
            let escaped = *bytes.get(self.at + 1)?;
            self.at += 2;
            units.push(match escaped {
                b'"' => 0x22,
                b'\\' => 0x5c,
                b'/' => 0x2f,
                b'b' => 0x08,
                b'f' => 0x0c,
                b'n' => 0x0a,
                b'r' => 0x0d,
                b't' => 0x09,
                b'u' => {
                    let hex = self.text.get(self.at..self.at + 4)?;
                    self.at += 4;
                    u16::from_str_radix(hex, 16).ok()?
                }
                _ => return None,
            });
        }
    }
}

/// Python's `repr()` of a float: the shortest digits that read back as it,
/// positional from 1e-4 up to below 1e16, else with an exponent.
fn float_repr(f: f64, out: &mut String) {
    if f.is_infinite() {
        out.push_str(if f > 0.0 { "inf" } else { "-inf" });
        return;
    }
    if f.is_sign_negative() {
        out.push('-');
    }
    if f == 0.0 {
        out.push_str("0.0");
        return;
    }
    let (digits, exponent) = shortest_digits(f.abs());
    if !(-4..16).contains(&exponent) {
        let (first, rest) = digits.split_at(1);
        out.push_str(first);
        if !rest.is_empty() {
            out.push('.');
            out.push_str(rest);
        }
        let sign = if exponent < 0 { '-' } else { '+' };
        out.push_str(&format!("e{sign}{:02}", exponent.unsigned_abs()));
    } else if exponent < 0 {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-exponent - 1) as usize));
        out.push_str(&digits);
    } else {
        let point = exponent as usize + 1;
        if digits.len() > point {
            out.push_str(&digits[..point]);
            out.push('.');
            out.push_str(&digits[point..]);
        } else {
            out.push_str(&digits);
            out.extend(std::iter::repeat_n('0', point - digits.len()));
            out.push_str(".0");
        }
    }
}

/// The shortest digits that read back as `f` (finite, above zero) and the
/// power of ten of the first, as Python's `repr` picks them: of two such
/// equally near, the one with an even last digit (Rust's `{:e}` rounds such
/// a tie up).
fn shortest_digits(f: f64) -> (String, i32) {
    let (digits, exponent) = scientific(&format!("{f:e}"));
    // An f64 has at most 767 significant decimal digits: this is exact.
    let (exact, exact_exponent) = scientific(&format!("{f:.767e}"));
    let n = digits.len();
    let tie = exact_exponent == exponent
        && exact.as_bytes().get(n) == Some(&b'5')
        && exact.bytes().skip(n + 1).all(|b| b == b'0');
    if !tie {
        return (digits, exponent);
    }
    let (head, last) = exact[..n].split_at(n - 1);
    let last = last.as_bytes()[0] - b'0';
    let even = match last {
        0 | 2 | 4 | 6 | 8 => format!("{head}{last}"),
        9 => return (digits, exponent),
        _ => format!("{head}{}", last + 1),
    };
    let even = even.trim_end_matches('0');
    let reads_back = format!("0.{even}e{}", exponent + 1).parse() == Ok(f);
    if reads_back && !even.is_empty() {
        (even.to_string(), exponent)
    } else {
        (digits, exponent)
    }
}

/// `d.ddde±x`, as Rust's `{:e}` writes it, as its digits and `x`.
fn scientific(text: &str) -> (String, i32) {
    let (mantissa, exponent) = text.split_once('e').expect("{:e} writes an exponent");
    let digits = mantissa.chars().filter(|c| *c != '.').collect();
    let exponent = exponent.parse().expect("{:e} writes an integer exponent");
    (digits, exponent)
}

/// Python's `repr()` of a string: single quotes unless it holds one and no
/// double quote; backslash escapes for the quote, `\`, `\t`, `\n`, `\r`;
/// `\xNN`, `\uNNNN`, `\UNNNNNNNN` for what Python does not print.
fn str_repr(units: &[u16], out: &mut String) {
    let quote = if units.contains(&u16::from(b'\'')) && !units.contains(&u16::from(b'"')) {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in char::decode_utf16(units.iter().copied()) {
        match c {
            Err(lone) => out.push_str(&format!("\\u{:04x}", lone.unpaired_surrogate())),
            Ok(c) if c == quote || c == '\\' => {
                out.push('\\');
                out.push(c);
            }
            Ok('\t') => out.push_str("\\t"),
            Ok('\n') => out.push_str("\\n"),
            Ok('\r') => out.push_str("\\r"),
            Ok(c) if c < ' ' || c == '\x7f' => out.push_str(&format!("\\x{:02x}", c as u32)),
            Ok(c) if c.is_ascii() || python_prints(c) => out.push(c),
            Ok(c) => {
                let c = c as u32;
                out.push_str(&if c <= 0xff {
                    format!("\\x{c:02x}")
                } else if c <= 0xffff {
                    format!("\\u{c:04x}")
                } else {
                    format!("\\U{c:08x}")
                });
            }
        }
    }
    out.push(quote);
}

/// Code points past ASCII that Python's `str.isprintable()` refuses: its
/// controls, format characters, separators but the space, surrogates and
/// private use, with unassigned ones around them that no Unicode version
/// has given a printable character, so a range is whole.
const NOT_PRINTED: [(u32, u32); 26] = [
    (0x80, 0xa0),
    (0xad, 0xad),
    (0x600, 0x605),
    (0x61c, 0x61c),
    (0x6dd, 0x6dd),
    (0x70f, 0x70f),
    (0x890, 0x891),
    (0x8e2, 0x8e2),
    (0x1680, 0x1680),
    (0x180e, 0x180e),
    (0x2000, 0x200f),
    (0x2028, 0x202f),
    (0x205f, 0x206f),
    (0x3000, 0x3000),
    (0xd800, 0xf8ff),
    (0xfdd0, 0xfdef),
    (0xfeff, 0xfeff),
    (0xfff0, 0xfffb),
    (0x110bd, 0x110bd),
    (0x110cd, 0x110cd),
    (0x13430, 0x1343f),
    (0x1bca0, 0x1bca3),
    (0x1d173, 0x1d17a),
    (0x40000, 0xdffff),
    (0xe0000, 0xe00ff),
    (0xe01f0, 0x10ffff),
];

fn python_prints(c: char) -> bool {
    let c = c as u32;
    // U+xFFFE and U+xFFFF of every plane are noncharacters.
    c & 0xfffe != 0xfffe
        && !NOT_PRINTED
            .iter()
            .any(|&(from, to)| (from..=to).contains(&c))
}

/// `python_str_or_empty` against a table of what Python gives, and against
/// `str(json.loads(text) or "")` run by `python3` itself.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::parse_request;

    /// `(JSON text, str(json.loads(text) or ""))`.
    const TABLE: &[(&str, &str)] = &[
        // Falsy: nothing.
        ("null", ""),
        ("false", ""),
        ("0", ""),
        ("-0", ""),
        ("0.0", ""),
        ("-0.0", ""),
        ("0e5", ""),
        ("1e-400", ""),
        (r#""""#, ""),
        ("[]", ""),
        ("{}", ""),
        (" [ ] ", ""),
        // Scalars.
        ("true", "True"),
        (r#""c1""#, "c1"),
        (r#"" spaced \"q\" ""#, r#" spaced "q" "#),
        (r#""é\u00e9\ud83d\ude00""#, "éé😀"),
        (r#""nul\u0000""#, "nul\0"),
        (r#""\ud800""#, "\u{fffd}"),
        ("7", "7"),
        ("-7", "-7"),
        (
            "123456789012345678901234567890",
            "123456789012345678901234567890",
        ),
        // Floats: a fraction or an exponent makes one; repr's digits.
        ("1.0", "1.0"),
        ("1E2", "100.0"),
        ("1e2", "100.0"),
        ("-1.5", "-1.5"),
        ("1000.0", "1000.0"),
        ("0.1", "0.1"),
        ("0.30000000000000004", "0.30000000000000004"),
        ("12345.678e-3", "12.345678"),
        ("0.0001", "0.0001"),
        ("0.00001", "1e-05"),
        ("2.5e-5", "2.5e-05"),
        ("1e15", "1000000000000000.0"),
        ("1e16", "1e+16"),
        ("1.5e16", "1.5e+16"),
        ("9999999999999998.0", "9999999999999998.0"),
        ("1e100", "1e+100"),
        ("1.7976931348623157e308", "1.7976931348623157e+308"),
        ("5e-324", "5e-324"),
        ("1e999", "inf"),
        ("-1e999", "-inf"),
        // Lists and dicts: repr, all the way down.
        (r#"[1, "a", true, null]"#, "[1, 'a', True, None]"),
        (r#"{"k": 1.5}"#, "{'k': 1.5}"),
        (
            r#"[[], {}, [0], -0, -0.0, 0.0, false, "", 1e999]"#,
            "[[], {}, [0], 0, -0.0, 0.0, False, '', inf]",
        ),
        (
            r#"{"k": {"n": [1.0, 1e16, 1E-7]}}"#,
            "{'k': {'n': [1.0, 1e+16, 1e-07]}}",
        ),
        (r#"{"a": 1, "b": 2, "a": 3}"#, "{'a': 3, 'b': 2}"),
        ("[ 1 ,\n2 ]", "[1, 2]"),
        // Quoting: single quotes unless only single quotes are inside.
        (r#"["it's"]"#, r#"["it's"]"#),
        (r#"["say \"hi\""]"#, r#"['say "hi"']"#),
        (r#"["it's \"q\""]"#, r#"['it\'s "q"']"#),
        (
            r#"["a\\b\n\r\t\u0001\u001f\u007f"]"#,
            r"['a\\b\n\r\t\x01\x1f\x7f']",
        ),
        (
            r#"["é€😀\u0085\u00a0\u00ad\u200b\u2028\u3000\ufeff\ue000"]"#,
            r"['é€😀\x85\xa0\xad\u200b\u2028\u3000\ufeff\ue000']",
        ),
        (
            r#"["\ud800", "\ud83d\ude00", "\udc00x", "\ud83d"]"#,
            r"['\ud800', '😀', '\udc00x', '\ud83d']",
        ),
        (
            r#"["\udb40\udc01", "\ud900\udc00", "\udbc0\udc00"]"#,
            r"['\U000e0001', '\U00050000', '\U00100000']",
        ),
        (r#"{"\n": "\\"}"#, r"{'\n': '\\'}"),
    ];

    fn shown(text: &str) -> String {
        let raw: Box<RawValue> = serde_json::from_str(text).expect("JSON");
        python_str_or_empty(Some(&raw))
    }

    #[test]
    fn str_of_an_env_value_is_pythons() {
        for (json, shown) in [
            ("true", "True"),
            ("false", "False"),
            ("0", "0"),
            ("null", "None"),
            ("1.5", "1.5"),
            ("1E2", "100.0"),
            ("\"text\"", "text"),
            ("[1, \"a\"]", "[1, 'a']"),
        ] {
            let raw = RawValue::from_string(json.to_string()).unwrap();
            assert_eq!(python_str(&raw), shown, "{json}");
        }
    }

    #[test]
    fn the_table() {
        for (text, expected) in TABLE {
            assert_eq!(&shown(text), expected, "str(json.loads({text:?}) or \"\")");
        }
        assert_eq!(python_str_or_empty(None), "");
    }

    #[test]
    fn a_call_id_reads_as_the_reference_reads_it() {
        let line = |call_id: &str| {
            let line = format!(r#"{{"op":"run","flow":"f","node":"n","call_id":{call_id}}}"#);
            parse_request(line.as_bytes()).unwrap().call_id
        };
        assert_eq!(line("true"), "True");
        assert_eq!(line("false"), "");
        assert_eq!(line("1.0"), "1.0");
        assert_eq!(line(r#"["a"]"#), "['a']");
        assert_eq!(line(r#""c1""#), "c1");
    }

    #[test]
    fn keep_is_python_truth() {
        for (keep, kept) in [
            ("true", true),
            ("1", true),
            ("0.5", true),
            (r#""no""#, true),
            ("[0]", true),
            ("false", false),
            ("0", false),
            ("-0.0", false),
            ("1e-999", false),
            (r#""""#, false),
            ("[]", false),
            ("{}", false),
            ("null", false),
        ] {
            let line = format!(r#"{{"op":"compile","flow":"f","node":"n","keep":{keep}}}"#);
            assert_eq!(parse_request(line.as_bytes()).unwrap().keep, kept, "{keep}");
        }
    }

    /// As deep as a request may nest inside its line, and one level more.
    #[test]
    fn depth_is_bounded() {
        let nested = |levels: usize| format!("{}1{}", "[".repeat(levels), "]".repeat(levels));
        let deepest = shown(&nested(MAX_NESTING - 1));
        assert_eq!(deepest.len(), 2 * (MAX_NESTING - 1) + 1);
        assert_eq!(shown(&nested(MAX_NESTING)), "");
    }

    /// xorshift64: the same cases on every run.
    struct Draw(u64);

    impl Draw {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// Code points whose printability no Unicode version since Python
    /// 3.8's has changed (unassigned ones are not covered).
    const CHARACTERS: &[(u32, u32)] = &[
        (0x20, 0x7e),
        (0x00, 0x1f),
        (0x7f, 0xff),
        (0x100, 0x17f),
        (0x391, 0x3a1),
        (0x2000, 0x206f),
        (0x3000, 0x3003),
        (0x4e00, 0x9fa5),
        (0xac00, 0xd7a3),
        (0xd800, 0xdfff),
        (0xe000, 0xe010),
        (0xfeff, 0xfeff),
        (0xfff0, 0xffff),
        (0x10000, 0x1000b),
        (0x1f600, 0x1f64f),
        (0x40000, 0x40010),
        (0xe0000, 0xe01ff),
        (0x100000, 0x100010),
    ];

    /// A JSON string of drawn code points, each written as itself or as
    /// an escape (a surrogate always as an escape).
    fn string(draw: &mut Draw) -> String {
        let mut text = String::from('"');
        for _ in 0..draw.below(6) {
            let (from, to) = CHARACTERS[draw.below(CHARACTERS.len() as u64) as usize];
            let c = from + draw.below(u64::from(to - from + 1)) as u32;
            match char::from_u32(c) {
                Some(c) if c >= ' ' && c != '"' && c != '\\' && draw.below(2) == 0 => {
                    text.push(c);
                }
                Some(c) => {
                    for unit in c.encode_utf16(&mut [0; 2]) {
                        text.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                // A surrogate, kept lone: two drawn side by side could make
                // a code point of the unassigned ones not covered.
                None => text.push_str(&format!("\\u{c:04x}x")),
            }
        }
        text.push('"');
        text
    }

    /// Numbers as JSON may write them: floats from any bits, in both of
    /// Rust's notations, drawn digits and exponents, ints of any length.
    fn number(draw: &mut Draw) -> String {
        match draw.below(4) {
            0 => {
                let f = f64::from_bits(draw.next());
                let f = if f.is_finite() { f } else { 1.0 / 3.0 };
                if draw.below(2) == 0 {
                    format!("{f:e}")
                } else {
                    format!("{f}")
                }
            }
            1 => {
                let digits: String = (0..1 + draw.below(25))
                    .map(|_| char::from(b'0' + draw.below(10) as u8))
                    .collect();
                let exponent = draw.below(700) as i64 - 350;
                format!("0.{digits}e{exponent}")
            }
            2 => {
                let shift = draw.below(40);
                let f = (draw.below(1 << 53) as f64) / (1u64 << shift) as f64;
                format!("{f:?}")
            }
            _ => {
                let first = char::from(b'1' + draw.below(9) as u8);
                let rest: String = (0..draw.below(60))
                    .map(|_| char::from(b'0' + draw.below(10) as u8))
                    .collect();
                let sign = if draw.below(2) == 0 { "-" } else { "" };
                format!("{sign}{first}{rest}")
            }
        }
    }

    fn value(draw: &mut Draw, depth: u32) -> String {
        match draw.below(if depth > 2 { 5 } else { 7 }) {
            0 => ["null", "true", "false"][draw.below(3) as usize].to_string(),
            1 | 2 => number(draw),
            3 | 4 => string(draw),
            5 => {
                let items: Vec<String> =
                    (0..draw.below(4)).map(|_| value(draw, depth + 1)).collect();
                format!("[{}]", items.join(", "))
            }
            _ => {
                let pairs: Vec<String> = (0..draw.below(4))
                    .map(|_| format!("{}: {}", string(draw), value(draw, depth + 1)))
                    .collect();
                format!("{{{}}}", pairs.join(","))
            }
        }
    }

    #[test]
    fn python_agrees() {
        let mut draw = Draw(0x9e37_79b9_7f4a_7c15);
        let mut texts: Vec<String> = TABLE.iter().map(|(text, _)| text.to_string()).collect();
        for _ in 0..1000 {
            texts.push(number(&mut draw));
            texts.push(format!("[{}]", number(&mut draw)));
            texts.push(format!("[{}]", string(&mut draw)));
            texts.push(value(&mut draw, 0));
        }
        // A lone surrogate in a string on its own is what a Rust String
        // cannot hold: both sides replace it.
        let script = r#"
import json, sys
shown = [str(json.loads(text) or "") for text in json.load(sys.stdin)]
json.dump([s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace") for s in shown], sys.stdout)
"#;
        let mut python = std::process::Command::new("python3")
            .args(["-c", script])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3 on PATH");
        let input = serde_json::to_vec(&texts).unwrap();
        let mut stdin = python.stdin.take().unwrap();
        let writer = std::thread::spawn(move || std::io::Write::write_all(&mut stdin, &input));
        let output = python.wait_with_output().unwrap();
        writer.join().unwrap().unwrap();
        assert!(output.status.success(), "python3 failed");
        let expected: Vec<String> = serde_json::from_slice(&output.stdout).unwrap();
        assert_eq!(expected.len(), texts.len());
        let mut wrong = Vec::new();
        for (text, expected) in texts.iter().zip(&expected) {
            let ours = shown(text);
            if &ours != expected {
                wrong.push(format!(
                    "{text}\n  python: {expected:?}\n  ours:   {ours:?}"
                ));
            }
        }
        assert!(
            wrong.is_empty(),
            "{} differ:\n{}",
            wrong.len(),
            wrong.join("\n")
        );
    }
}
