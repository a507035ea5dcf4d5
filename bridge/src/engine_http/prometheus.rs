//! A small parser of the Prometheus text exposition format (0.0.4, and the OpenMetrics lines
//! engines' client libraries also print): comments and `# HELP` / `# TYPE` lines are skipped,
//! labels may come in any order with escaped quotes, values may be `NaN`, `±Inf` or have
//! exponents, and a timestamp may follow the value. A line it cannot read is counted and
//! skipped, never fatal: an engine's `/metrics` holds hundreds of series we do not need.

use std::borrow::Cow;

/// One sample line: `name{labels} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    pub value: f64,
    pub timestamp_ms: Option<i64>,
}

impl Sample<'_> {
    /// The value of label `name`, if the sample has it.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_ref())
    }
}

/// The samples of a page that `keep` wanted, and how many lines could not be read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Exposition<'a> {
    pub samples: Vec<Sample<'a>>,
    pub malformed: usize,
}

impl<'a> Exposition<'a> {
    /// Samples of metric `name`, in page order.
    pub fn named<'s>(&'s self, name: &'s str) -> impl Iterator<Item = &'s Sample<'a>> + 's {
        self.samples.iter().filter(move |s| s.name == name)
    }
}

/// Parses `text`, keeping the samples whose metric name `keep` accepts (the others are not
/// even split into labels, so a large page costs little).
pub fn parse<'a>(text: &'a str, keep: impl Fn(&str) -> bool) -> Exposition<'a> {
    let mut out = Exposition::default();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(|c: char| !is_name_char(c)).unwrap_or(line.len());
        let name = &line[..name_end];
        if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
            out.malformed += 1;
            continue;
        }
        if !keep(name) {
            continue;
        }
        match parse_rest(&line[name_end..]) {
            Some((labels, value, timestamp_ms)) => out.samples.push(Sample {
                name,
                labels,
                value,
                timestamp_ms,
            }),
            None => out.malformed += 1,
        }
    }
    out
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

type Labels<'a> = Vec<(&'a str, Cow<'a, str>)>;

/// After the name: optional `{labels}`, the value, an optional timestamp.
fn parse_rest(rest: &str) -> Option<(Labels<'_>, f64, Option<i64>)> {
    let rest = rest.trim_start();
    let (labels, rest) = if let Some(inner) = rest.strip_prefix('{') {
        parse_labels(inner)?
    } else {
        (Vec::new(), rest)
    };
    let mut fields = rest.split_ascii_whitespace();
    let value = parse_value(fields.next()?)?;
    let timestamp_ms = match fields.next() {
        // OpenMetrics timestamps are seconds with a fraction; 0.0.4's are integer ms.
        Some(t) => Some(t.parse::<i64>().ok().or_else(|| {
            t.parse::<f64>()
                .ok()
                .filter(|s| s.is_finite())
                .map(|s| (s * 1e3) as i64)
        })?),
        None => None,
    };
    if fields.next().is_some() {
        return None;
    }
    Some((labels, value, timestamp_ms))
}

/// `inner` is what follows `{`; returns the labels and what follows `}`.
fn parse_labels(mut inner: &str) -> Option<(Labels<'_>, &str)> {
    let mut labels = Vec::new();
    loop {
        inner = inner.trim_start();
        if let Some(rest) = inner.strip_prefix('}') {
            return Some((labels, rest));
        }
        let name_end = inner.find(|c: char| !is_name_char(c))?;
        let name = &inner[..name_end];
        if name.is_empty() {
            return None;
        }
        let rest = inner[name_end..].trim_start().strip_prefix('=')?;
        let rest = rest.trim_start().strip_prefix('"')?;
        let (value, rest) = parse_quoted(rest)?;
        labels.push((name, value));
        inner = rest.trim_start();
        if let Some(rest) = inner.strip_prefix(',') {
            inner = rest;
        } else if !inner.starts_with('}') {
            return None;
        }
    }
}

/// `s` follows an opening quote; returns the unescaped value and what follows the closing one.
fn parse_quoted(s: &str) -> Option<(Cow<'_, str>, &str)> {
    let bytes = s.as_bytes();
    let mut i = 0;
    let mut owned: Option<String> = None;
    let mut start = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                let value = match owned {
                    Some(mut o) => {
                        o.push_str(&s[start..i]);
                        Cow::Owned(o)
                    }
                    None => Cow::Borrowed(&s[..i]),
                };
                return Some((value, &s[i + 1..]));
            }
            b'\\' => {
                let o = owned.get_or_insert_with(String::new);
                o.push_str(&s[start..i]);
                match bytes.get(i + 1)? {
                    b'n' => o.push('\n'),
                    b'\\' => o.push('\\'),
                    b'"' => o.push('"'),
                    // Not an escape the format defines: keep both characters.
                    _ => o.push('\\'),
                }
                i += if matches!(bytes[i + 1], b'n' | b'\\' | b'"') {
                    2
                } else {
                    1
                };
                start = i;
            }
            _ => i += 1,
        }
    }
    None
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "NaN" | "nan" => Some(f64::NAN),
        "+Inf" | "Inf" | "+inf" | "inf" => Some(f64::INFINITY),
        "-Inf" | "-inf" => Some(f64::NEG_INFINITY),
        _ => s.parse().ok(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Trimmed from a vLLM 0.32 server's `/metrics` (two data-parallel engines).
    pub(crate) const VLLM_PAGE: &str = r#"# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12734.0
python_gc_objects_collected_total{generation="1"} 1932.0
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.76461228183e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 2.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="Qwen/Qwen3-0.6B",reason="capacity"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.0625
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 4.212e+04
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3-0.6B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 118.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-0.6B"} NaN
vllm:time_to_first_token_seconds_created{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.7646122877e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",kv_cache_memory_bytes="None",num_cpu_blocks="None",num_gpu_blocks="27153",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",is_attention_free="False",kv_cache_memory_bytes="None",num_cpu_blocks="None",num_gpu_blocks="27153",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4"} 1.0
"#;

    fn all(text: &str) -> Exposition<'_> {
        parse(text, |_| true)
    }

    #[test]
    fn reads_a_vllm_page() {
        let page = all(VLLM_PAGE);
        assert_eq!(page.malformed, 0);
        let running: Vec<_> = page
            .named("vllm:num_requests_running")
            .map(|s| (s.label("engine"), s.value))
            .collect();
        assert_eq!(running, [(Some("0"), 3.0), (Some("1"), 1.0)]);
        let start = page.named("process_start_time_seconds").next().unwrap();
        assert_eq!(start.value, 1.76461228183e9);
        assert!(start.labels.is_empty());
        let sum = page
            .named("vllm:time_to_first_token_seconds_sum")
            .next()
            .unwrap();
        assert!(sum.value.is_nan());
        let inf = page
            .named("vllm:time_to_first_token_seconds_bucket")
            .find(|s| s.label("le") == Some("+Inf"))
            .unwrap();
        assert_eq!(inf.value, 118.0);
        let info = page.named("vllm:cache_config_info").nth(1).unwrap();
        assert_eq!(info.label("block_size"), Some("16"));
        assert_eq!(info.label("num_gpu_blocks"), Some("27153"));
        assert_eq!(info.label("engine"), Some("1"));
        assert_eq!(info.label("hash_block_size"), None);
    }

    #[test]
    fn keep_filters_before_labels_are_read() {
        let page = parse(VLLM_PAGE, |n| n == "vllm:kv_cache_usage_perc");
        assert_eq!(page.samples.len(), 2);
        // A broken line of an unwanted metric is not even looked at.
        let page = parse("other{a=\"\n vllm:x 1\n", |n| n == "vllm:x");
        assert_eq!((page.samples.len(), page.malformed), (1, 0));
    }

    #[test]
    fn escapes_spacing_timestamps_and_special_values() {
        let text = "m{path=\"C:\\\\dir\",msg=\"say \\\"hi\\\"\\nbye\" , odd=\"a\\tb\",} -Inf 1700000000000\n\
                    m { a = \"1\" } +Inf\n\
                    m{} 2.5e-3 1700000000.25\n\
                    m 7\r\n\
                    m\t8\n\
                    # EOF\n";
        let page = all(text);
        assert_eq!(page.malformed, 0, "{page:?}");
        let s = &page.samples;
        assert_eq!(s.len(), 5);
        assert_eq!(s[0].label("path"), Some("C:\\dir"));
        assert_eq!(s[0].label("msg"), Some("say \"hi\"\nbye"));
        assert_eq!(s[0].label("odd"), Some("a\\tb"));
        assert_eq!(s[0].value, f64::NEG_INFINITY);
        assert_eq!(s[0].timestamp_ms, Some(1_700_000_000_000));
        assert_eq!((s[1].label("a"), s[1].value), (Some("1"), f64::INFINITY));
        assert_eq!(s[2].value, 0.0025);
        assert_eq!(s[2].timestamp_ms, Some(1_700_000_000_250));
        assert_eq!((s[3].value, s[4].value), (7.0, 8.0));
    }

    #[test]
    fn bad_lines_are_counted_and_skipped() {
        let text = "ok 1\n\
                    unterminated{a=\"x} 1\n\
                    nolabelvalue{a} 1\n\
                    novalue{a=\"1\"}\n\
                    word abc\n\
                    trailing 1 2 3\n\
                    9starts_with_digit 1\n\
                    {a=\"1\"} 1\n\
                    ok 2\n";
        let page = all(text);
        assert_eq!(page.malformed, 7, "{page:?}");
        let values: Vec<f64> = page.named("ok").map(|s| s.value).collect();
        assert_eq!(values, [1.0, 2.0]);
    }
}
