//! The request's `tools` as vLLM hands them to the template: each validated as an OpenAI
//! function tool and rebuilt in its own field order (`ChatCompletionToolsParam.model_dump()`),
//! so `{{ tool | tojson }}` prints what vLLM prints — `description` and `parameters` as `null`
//! when absent, unknown fields dropped.

use serde_json::{Map, Value};

use crate::TextError;

/// `None` for no tools (`null` or absent); else the canonical list.
pub(crate) fn canonical_tools(tools: Option<&Value>) -> Result<Option<Vec<Value>>, TextError> {
    let tools = match tools {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(tools)) => tools,
        Some(_) => return Err(TextError::input("tools must be a list")),
    };
    tools
        .iter()
        .enumerate()
        .map(|(i, tool)| {
            canonical_tool(tool).map_err(|e| TextError::input(format!("tools[{i}]: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn canonical_tool(tool: &Value) -> Result<Value, String> {
    let tool = tool.as_object().ok_or("a tool must be an object")?;
    match tool.get("type") {
        None => {}
        Some(Value::String(t)) if t == "function" => {}
        Some(_) => return Err("type must be \"function\"".into()),
    }
    let function = match tool.get("function") {
        Some(Value::Object(f)) => f,
        _ => return Err("a tool needs a function object".into()),
    };
    let tool_defer = optional(tool, "defer_loading", Value::is_boolean, "a boolean")?;
    let mut out_fn = Map::new();
    match function.get("name") {
        Some(Value::String(name)) => out_fn.insert("name".into(), Value::String(name.clone())),
        _ => return Err("function.name must be a string".into()),
    };
    let description = optional(function, "description", Value::is_string, "a string")?;
    out_fn.insert("description".into(), description.unwrap_or(Value::Null));
    let parameters = optional(function, "parameters", Value::is_object, "an object")?;
    out_fn.insert("parameters".into(), parameters.unwrap_or(Value::Null));
    if let Some(strict) = optional(function, "strict", Value::is_boolean, "a boolean")? {
        out_fn.insert("strict".into(), strict);
    }
    // A tool-level defer_loading is copied onto a function that has none.
    if let Some(defer) =
        optional(function, "defer_loading", Value::is_boolean, "a boolean")?.or(tool_defer.clone())
    {
        out_fn.insert("defer_loading".into(), defer);
    }
    let mut out = Map::new();
    out.insert("type".into(), Value::String("function".into()));
    out.insert("function".into(), Value::Object(out_fn));
    if let Some(defer) = tool_defer {
        out.insert("defer_loading".into(), defer);
    }
    Ok(Value::Object(out))
}

/// The field's value if present and not null; an error if it has the wrong type.
fn optional(
    obj: &Map<String, Value>,
    key: &str,
    ok: fn(&Value) -> bool,
    what: &str,
) -> Result<Option<Value>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) if ok(v) => Ok(Some(v.clone())),
        Some(_) => Err(format!("{key} must be {what}")),
    }
}

#[cfg(test)]
mod tests {
    use super::canonical_tools;
    use serde_json::json;

    #[test]
    fn tools_take_vllms_shape() {
        let tools = json!([
            {"function": {"parameters": {"b": 1, "a": 2}, "name": "f", "x": 1}, "extra": true},
            {"type": "function", "function": {"name": "g", "strict": true}, "defer_loading": false},
        ]);
        let out = canonical_tools(Some(&tools)).unwrap().unwrap();
        assert_eq!(
            serde_json::to_string(&out).unwrap(),
            r#"[{"type":"function","function":{"name":"f","description":null,"parameters":{"b":1,"a":2}}},{"type":"function","function":{"name":"g","description":null,"parameters":null,"strict":true,"defer_loading":false},"defer_loading":false}]"#
        );
        assert_eq!(canonical_tools(Some(&json!(null))).unwrap(), None);
        for (bad, why) in [
            (json!({}), "tools must be a list"),
            (json!([1]), "tools[0]: a tool must be an object"),
            (
                json!([{"type": "code"}]),
                "tools[0]: type must be \"function\"",
            ),
            (
                json!([{"function": {}}]),
                "tools[0]: function.name must be a string",
            ),
            (
                json!([{"function": {"name": "f", "parameters": []}}]),
                "tools[0]: parameters must be an object",
            ),
        ] {
            assert_eq!(canonical_tools(Some(&bad)).unwrap_err().to_string(), why);
        }
    }
}
