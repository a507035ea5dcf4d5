//! Python methods on template values: minijinja-contrib's pycompat (`str.strip`, `.split`,
//! `.startswith`, `dict.items`, `.get`, …), plus the string methods chat templates use that it
//! lacks (`rsplit`, `removeprefix`, `removesuffix`, `partition`, `rpartition`) and Python's
//! notion of whitespace for `strip()` without arguments.

use minijinja::value::{Tuple, Value, ValueKind, from_args};
use minijinja::{Error, ErrorKind, State};

use super::pyfmt::is_py_space;

pub(crate) fn call_method(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let (ValueKind::String, Some(s)) = (value.kind(), value.as_str())
        && let Some(v) = string_method(s, method, args)?
    {
        return Ok(v);
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

fn string_method(s: &str, method: &str, args: &[Value]) -> Result<Option<Value>, Error> {
    let v = match (method, args.is_empty()) {
        ("strip", true) => Value::from(s.trim_matches(is_py_space)),
        ("lstrip", true) => Value::from(s.trim_start_matches(is_py_space)),
        ("rstrip", true) => Value::from(s.trim_end_matches(is_py_space)),
        ("removeprefix", _) => {
            let (prefix,): (&str,) = from_args(args)?;
            Value::from(s.strip_prefix(prefix).unwrap_or(s))
        }
        ("removesuffix", _) => {
            let (suffix,): (&str,) = from_args(args)?;
            Value::from(s.strip_suffix(suffix).unwrap_or(s))
        }
        ("partition", _) | ("rpartition", _) => {
            let (sep,): (&str,) = from_args(args)?;
            if sep.is_empty() {
                return Err(Error::new(ErrorKind::InvalidOperation, "empty separator"));
            }
            let found = if method == "partition" {
                s.find(sep)
            } else {
                s.rfind(sep)
            };
            let parts = match found {
                Some(i) => [&s[..i], sep, &s[i + sep.len()..]],
                None if method == "partition" => [s, "", ""],
                None => ["", "", s],
            };
            Value::from(Tuple::from(parts.map(Value::from)))
        }
        ("rsplit", _) => {
            let (sep, maxsplit): (Option<&str>, Option<i64>) = from_args(args)?;
            Value::from(rsplit(s, sep, maxsplit.unwrap_or(-1)))
        }
        _ => return Ok(None),
    };
    Ok(Some(v))
}

/// Python's `str.rsplit(sep=None, maxsplit=-1)`.
fn rsplit(s: &str, sep: Option<&str>, maxsplit: i64) -> Vec<Value> {
    let limit = if maxsplit < 0 {
        usize::MAX
    } else {
        maxsplit as usize
    };
    let mut parts: Vec<&str> = Vec::new();
    match sep.filter(|sep| !sep.is_empty()) {
        Some(sep) => {
            let mut rest = s;
            while parts.len() < limit {
                match rest.rfind(sep) {
                    Some(i) => {
                        parts.push(&rest[i + sep.len()..]);
                        rest = &rest[..i];
                    }
                    None => break,
                }
            }
            parts.push(rest);
        }
        None => {
            let mut rest = s.trim_end_matches(is_py_space);
            while !rest.is_empty() {
                if parts.len() == limit {
                    parts.push(rest.trim_end_matches(is_py_space));
                    break;
                }
                match rest.rfind(is_py_space) {
                    Some(i) => {
                        let ch = rest[i..].chars().next().map_or(1, char::len_utf8);
                        parts.push(&rest[i + ch..]);
                        rest = rest[..i].trim_end_matches(is_py_space);
                    }
                    None => {
                        parts.push(rest);
                        rest = "";
                    }
                }
            }
        }
    }
    parts.reverse();
    parts.into_iter().map(Value::from).collect()
}

#[cfg(test)]
mod tests {
    use super::rsplit;
    use minijinja::value::Value;

    fn strs(v: Vec<Value>) -> Vec<String> {
        v.into_iter()
            .map(|v| v.as_str().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn rsplit_is_pythons() {
        assert_eq!(strs(rsplit("a,b,c", Some(","), 1)), ["a,b", "c"]);
        assert_eq!(strs(rsplit("a,b,c", Some(","), -1)), ["a", "b", "c"]);
        assert_eq!(strs(rsplit(",a,", Some(","), -1)), ["", "a", ""]);
        assert_eq!(strs(rsplit("  a  b c ", None, 1)), ["  a  b", "c"]);
        assert_eq!(strs(rsplit("  a  b c ", None, -1)), ["a", "b", "c"]);
        assert!(rsplit("   ", None, -1).is_empty());
    }
}
