//! The `tojson` filter as transformers defines it: Python's
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, with the
//! same argument names and defaults, and byte-identical output for JSON-like values.

use std::fmt::Write;

use minijinja::value::{Kwargs, Rest, Value, ValueKind};
use minijinja::{Error, ErrorKind};

use super::pyfmt::{MAX_DEPTH, f64_of, float_repr};

/// The widest `indent` accepted (Python has no limit; this keeps a template from asking for
/// gigabytes of spaces).
const MAX_INDENT: i64 = 1024;

/// `json.dumps`'s options.
#[derive(Debug, Clone)]
pub(crate) struct DumpOptions {
    pub ensure_ascii: bool,
    /// `None`: one line. `Some(s)`: a newline and `s` per level (`indent=4` is four spaces).
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
}

impl DumpOptions {
    /// Python's defaults for the given indent: `(', ', ': ')` on one line, `(',', ': ')` indented.
    pub(crate) fn new(indent: Option<String>) -> Self {
        let item_separator = if indent.is_some() { "," } else { ", " };
        DumpOptions {
            ensure_ascii: false,
            indent,
            item_separator: item_separator.into(),
            key_separator: ": ".into(),
            sort_keys: false,
        }
    }
}

/// The filter: `x | tojson`, `tojson(indent=2)`, `tojson(separators=(',', ':'))`,
/// `tojson(sort_keys=true)`, `tojson(ensure_ascii=true)`; positional arguments in the order of
/// transformers' signature (`ensure_ascii, indent, separators, sort_keys`).
pub(crate) fn tojson_filter(
    value: &Value,
    args: Rest<Value>,
    kwargs: Kwargs,
) -> Result<String, Error> {
    let mut slots: [Option<Value>; 4] = Default::default();
    if args.len() > slots.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    for (slot, arg) in slots.iter_mut().zip(args.iter()) {
        *slot = Some(arg.clone());
    }
    for (i, name) in ["ensure_ascii", "indent", "separators", "sort_keys"]
        .iter()
        .enumerate()
    {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            if slots[i].is_some() {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson got multiple values for argument '{name}'"),
                ));
            }
            slots[i] = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = slots;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_owned(),
            None => {
                let n = i64::try_from(v).map_err(|_| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an integer or a string",
                    )
                })?;
                if n > MAX_INDENT {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent is too large",
                    ));
                }
                " ".repeat(n.max(0) as usize)
            }
        }),
    };
    let mut opts = DumpOptions::new(indent);
    opts.ensure_ascii = ensure_ascii.is_some_and(|v| v.is_true());
    opts.sort_keys = sort_keys.is_some_and(|v| v.is_true());
    if let Some(seps) = separators.filter(|v| !v.is_none()) {
        let parts: Vec<Value> = seps.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                opts.item_separator = item.as_str().unwrap_or_default().to_owned();
                opts.key_separator = key.as_str().unwrap_or_default().to_owned();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be a pair of strings",
                ));
            }
        }
    }
    let mut out = String::new();
    dump(value, &opts, &mut out, 0)?;
    Ok(out)
}

/// Appends `json.dumps(value)` to `out`.
pub(crate) fn dump(
    value: &Value,
    opts: &DumpOptions,
    out: &mut String,
    depth: usize,
) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => match f64_of(value) {
            Some(f) if f.is_nan() => out.push_str("NaN"),
            Some(f) if f.is_infinite() => {
                out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" })
            }
            Some(f) => out.push_str(&float_repr(f)),
            None => {
                let _ = write!(out, "{value}");
            }
        },
        ValueKind::String => quote(value.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            container(out, opts, depth, '[', ']', &items, |item, out| {
                dump(item, opts, out, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if opts.sort_keys {
                keys.sort();
            }
            container(out, opts, depth, '{', '}', &keys, |key, out| {
                dump_key(key, opts, out)?;
                out.push_str(&opts.key_separator);
                dump(&value.get_item(key)?, opts, out, depth + 1)
            })?;
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("Object of type {} is not JSON serializable", value.kind()),
            ));
        }
    }
    Ok(())
}

fn container(
    out: &mut String,
    opts: &DumpOptions,
    depth: usize,
    open: char,
    close: char,
    items: &[Value],
    mut each: impl FnMut(&Value, &mut String) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &opts.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    };
    newline(out, depth + 1);
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&opts.item_separator);
            newline(out, depth + 1);
        }
        each(item, out)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

/// Python turns non-string keys into strings: `1` → `"1"`, `True` → `"true"`, `None` → `"null"`.
fn dump_key(key: &Value, opts: &DumpOptions, out: &mut String) -> Result<(), Error> {
    match key.kind() {
        ValueKind::String => quote(key.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        ValueKind::Number | ValueKind::Bool | ValueKind::None => {
            let mut s = String::new();
            dump(key, opts, &mut s, 0)?;
            quote(&s, opts.ensure_ascii, out);
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "keys must be str, int, float, bool or None, not {}",
                    key.kind()
                ),
            ));
        }
    }
    Ok(())
}

/// A JSON string as Python writes it: `\"`, `\\`, `\n`, `\r`, `\t`, `\b`, `\f`, other controls as
/// `\u00XX`; non-ASCII as is, or as `\uXXXX` (surrogate pairs above U+FFFF) with `ensure_ascii`.
pub(crate) fn quote(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn dumps(v: serde_json::Value, opts: &DumpOptions) -> String {
        let mut out = String::new();
        dump(&Value::from(minijinja::value::Serde(v)), opts, &mut out, 0).unwrap();
        out
    }

    #[test]
    fn matches_python_json_dumps() {
        let v = json!({"b": [1, 2.0, "é\n\"", null, true], "a": {}, "c": []});
        // json.dumps(v, ensure_ascii=False)
        assert_eq!(
            dumps(v.clone(), &DumpOptions::new(None)),
            r#"{"b": [1, 2.0, "é\n\"", null, true], "a": {}, "c": []}"#
        );
        // json.dumps(v, ensure_ascii=False, indent=2)
        assert_eq!(
            dumps(v.clone(), &DumpOptions::new(Some("  ".into()))),
            "{\n  \"b\": [\n    1,\n    2.0,\n    \"é\\n\\\"\",\n    null,\n    true\n  ],\n  \"a\": {},\n  \"c\": []\n}"
        );
        // json.dumps(v, ensure_ascii=True, separators=(',', ':'), sort_keys=True)
        let mut opts = DumpOptions::new(None);
        opts.ensure_ascii = true;
        opts.sort_keys = true;
        opts.item_separator = ",".into();
        opts.key_separator = ":".into();
        assert_eq!(
            dumps(v, &opts),
            r#"{"a":{},"b":[1,2.0,"\u00e9\n\"",null,true],"c":[]}"#
        );
    }

    #[test]
    fn escapes_controls_and_astral_characters() {
        let mut out = String::new();
        quote("\u{1}\u{7f}😀", true, &mut out);
        assert_eq!(
            out,
            r#""\u0001\u007f\ud83d\ude00""#.replace("\\u007f", "\u{7f}")
        );
    }
}
