//! `GET /v1/models`, both engines': the served model and (vLLM) the LoRA adapters.

use serde_json::Value;

/// The first model id of a `/v1/models` answer (`{"object": "list", "data": [{"id": ..}]}`).
pub fn first_model(models: &Value) -> Option<String> {
    models
        .get("data")?
        .as_array()?
        .iter()
        .find_map(|m| m.get("id")?.as_str())
        .filter(|id| !id.is_empty())
        .map(str::to_owned)
}

/// The adapters of a `/v1/models` answer: the ids of the entries whose `parent` is a model
/// (vLLM lists each LoRA adapter so, its base model as `parent`). `None` when the answer has
/// no `data` list.
pub fn lora_adapters(models: &Value) -> Option<Vec<String>> {
    let data = models.get("data")?.as_array()?;
    let mut names: Vec<String> = data
        .iter()
        .filter(|m| {
            m.get("parent")
                .and_then(Value::as_str)
                .is_some_and(|p| !p.is_empty())
        })
        .filter_map(|m| m.get("id")?.as_str())
        .filter(|id| !id.is_empty())
        .map(str::to_owned)
        .collect();
    names.sort_unstable();
    names.dedup();
    Some(names)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_first_model_of_v1_models() {
        // vLLM lists the base model first, then LoRA adapters; SGLang likewise.
        let vllm: Value = serde_json::from_str(r#"{"object":"list","data":[{"id":"Qwen/Qwen3-0.6B","object":"model","created":1764612311,"owned_by":"vllm","root":"Qwen/Qwen3-0.6B","parent":null,"max_model_len":40960,"permission":[{"id":"modelperm-1","object":"model_permission"}]},{"id":"sql-lora","object":"model","parent":"Qwen/Qwen3-0.6B"}]}"#).unwrap();
        assert_eq!(first_model(&vllm).as_deref(), Some("Qwen/Qwen3-0.6B"));
        let empty: Value = serde_json::from_str(r#"{"object":"list","data":[]}"#).unwrap();
        assert_eq!(first_model(&empty), None);
        assert_eq!(first_model(&json!({"data": [{"id": ""}]})), None);
        assert_eq!(first_model(&json!([1])), None);
        // The entries naming a parent are the adapters.
        assert_eq!(lora_adapters(&vllm), Some(vec!["sql-lora".to_owned()]));
        assert_eq!(lora_adapters(&empty), Some(vec![]));
        assert_eq!(lora_adapters(&json!([1])), None);
        let odd = json!({"data": [{"id": "b", "parent": "m"}, {"id": "a", "parent": "m"},
                                  {"id": "b", "parent": "m"}, {"id": "", "parent": "m"},
                                  {"id": "c", "parent": ""}, {"parent": "m"}]});
        assert_eq!(
            lora_adapters(&odd),
            Some(vec!["a".to_owned(), "b".to_owned()])
        );
    }
}
