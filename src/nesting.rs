//! How deep JSON may nest before the runtime refuses it: a request, an
//! engine frame, a value rendered as Python shows it.

/// How deep a request (or an engine frame) may nest, the line itself
/// counting as one level. Python's `json` gives up near 1,000 levels (its
/// recursion limit) and the engine's `orjson.dumps` at 255, so 512 is below
/// what the engine can read back and above anything it can send.
pub const MAX_NESTING: usize = 512;

/// Whether `json` nests arrays and objects more than `limit` levels deep,
/// brackets inside strings not counted. A scan of the bytes, not a parse:
/// serde_json reads a `RawValue` without recursion, and so without its own
/// limit of 128, so nothing else stops a line 100,000 levels deep from being
/// echoed back to a reader that cannot take it.
pub fn nested_deeper_than(json: &[u8], limit: usize) -> bool {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for &byte in json {
        if in_string {
            if escaped {
                escaped = false;
            } else if byte == b'\\' {
                escaped = true;
            } else if byte == b'"' {
                in_string = false;
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > limit {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}
