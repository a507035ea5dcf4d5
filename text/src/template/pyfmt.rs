//! Values printed as Python prints them: `str(float)`, `repr(str)`, and `str()` of lists and
//! dicts (what Jinja2 shows for `{{ x }}`), so a template that prints a value renders the same
//! text as under transformers.

use std::fmt::Write;

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Containers nested deeper than this are refused (Python would recurse until its own limit).
pub(crate) const MAX_DEPTH: usize = 256;

/// Python's `repr(float)` (which `str(float)` equals): shortest round-trip digits, fixed
/// notation for 1e-4 <= |x| < 1e16 (with `.0` for integral values), else `1e+16` style.
pub(crate) fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Rust's `{:e}` is the shortest round-trip form, e.g. `-1.2345e-7`.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    // The value is 0.DIGITS × 10^decpt.
    let decpt = exp + 1;
    let mut out = String::from(sign);
    if !(-3..=16).contains(&decpt) {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    } else if decpt <= 0 {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-decpt) as usize));
        out.push_str(&digits);
    } else {
        let decpt = decpt as usize;
        if digits.len() <= decpt {
            out.push_str(&digits);
            out.extend(std::iter::repeat_n('0', decpt - digits.len()));
            out.push_str(".0");
        } else {
            out.push_str(&digits[..decpt]);
            out.push('.');
            out.push_str(&digits[decpt..]);
        }
    }
    out
}

/// Characters Python's `str.isprintable()` rejects, approximately: controls, separators other
/// than the space, and the common format characters (no Unicode tables: unassigned code points
/// count as printable here).
fn is_printable(c: char) -> bool {
    let u = c as u32;
    !matches!(u,
        0x00..=0x1f | 0x7f..=0xa0 | 0xad | 0x600..=0x605 | 0x61c | 0x6dd | 0x70f | 0x1680
        | 0x180e | 0x2000..=0x200f | 0x2028..=0x202f | 0x205f..=0x2064 | 0x2066..=0x206f
        | 0x3000 | 0xd800..=0xf8ff | 0xfeff | 0xfff9..=0xfffb | 0x110bd | 0x1d173..=0x1d17a
        | 0xe0001 | 0xe0020..=0xe007f | 0xf0000..)
}

/// Python's `repr(str)`.
pub(crate) fn str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if is_printable(c) => out.push(c),
            c if (c as u32) < 0x100 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if (c as u32) < 0x10000 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\U{:08x}", c as u32);
            }
        }
    }
    out.push(quote);
}

/// Python's `str(value)`: strings as they are, everything else as `repr`.
pub(crate) fn py_str(value: &Value, out: &mut String) -> Result<(), Error> {
    match value.kind() {
        ValueKind::String => out.push_str(value.as_str().unwrap_or_default()),
        ValueKind::Undefined => {}
        _ => py_repr(value, out, 0)?,
    }
    Ok(())
}

/// Python's `repr(value)` for the JSON-like values a chat template sees.
pub(crate) fn py_repr(value: &Value, out: &mut String, depth: usize) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "value nested too deeply to print",
        ));
    }
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::String => str_repr(value.as_str().unwrap_or_default(), out),
        ValueKind::Number => match f64_of(value) {
            Some(f) => out.push_str(&float_repr(f)),
            None => {
                let _ = write!(out, "{value}");
            }
        },
        ValueKind::Seq | ValueKind::Iterable => {
            let tuple = value.is_tuple();
            out.push(if tuple { '(' } else { '[' });
            let mut n = 0;
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&item, out, depth + 1)?;
                n += 1;
            }
            if tuple && n == 1 {
                out.push(',');
            }
            out.push(if tuple { ')' } else { ']' });
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&key, out, depth + 1)?;
                out.push_str(": ");
                py_repr(&value.get_item(&key)?, out, depth + 1)?;
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

/// The value as an f64 when it is a float (integers stay integers).
pub(crate) fn f64_of(value: &Value) -> Option<f64> {
    if value.is_integer() {
        return None;
    }
    f64::try_from(value.clone()).ok()
}

/// Python's `str.isspace()` per character (Unicode White_Space plus the four ASCII separators
/// 0x1c..0x1f), as `str.strip()` uses it.
pub(crate) fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.strip()` without arguments.
pub(crate) fn py_strip(s: &str) -> &str {
    s.trim_matches(is_py_space)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_prints_them() {
        for (f, py) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5, "-2.5"),
            (123456789012345680.0, "1.2345678901234568e+17"),
            (1234.5678, "1234.5678"),
            (1e300, "1e+300"),
            (-0.0, "-0.0"),
            (f64::NAN, "nan"),
            (f64::INFINITY, "inf"),
        ] {
            assert_eq!(float_repr(f), py, "{f:e}");
        }
    }

    #[test]
    fn strings_repr_as_python() {
        let r = |s: &str| {
            let mut o = String::new();
            str_repr(s, &mut o);
            o
        };
        assert_eq!(r("it's"), "\"it's\"");
        assert_eq!(r("a\"b'c"), "'a\"b\\'c'");
        assert_eq!(r("x\ny\t\\"), "'x\\ny\\t\\\\'");
        assert_eq!(r("\u{1}\u{7f}é\u{200b}日"), "'\\x01\\x7fé\\u200b日'");
    }

    #[test]
    fn containers_repr_as_python() {
        let v = Value::from(minijinja::value::Serde(
            serde_json::json!({"a": [1, 2.5, true, null, "x"]}),
        ));
        let mut o = String::new();
        py_str(&v, &mut o).unwrap();
        assert_eq!(o, "{'a': [1, 2.5, True, None, 'x']}");
    }
}
