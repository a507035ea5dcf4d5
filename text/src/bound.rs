//! A sound lower bound on a text's token count from its size alone, so a caller can refuse a
//! prompt that is provably too long without tokenizing it (tokenizing megabytes costs seconds
//! and gigabytes).
//!
//! One token stands for at most `L` bytes of the text as the model sees it (after its
//! normalizer and pre-tokenizer): the longest vocabulary entry or added token, in UTF-8 bytes
//! (a byte-level entry such as `Ġthe` is longer in UTF-8 than the bytes it stands for, and
//! `▁` longer than the space it replaces, so this over-estimates `L`, which keeps the bound
//! sound). The normalizer may shrink the text by at most a factor `S` (Unicode normalization
//! and lowercasing turn at most 3 bytes into 1: Hangul jamo, the Kelvin sign, full-width
//! forms; 4 is used). So `tokens ≥ bytes / (L·S)`.
//!
//! That holds only when no piece of the text can vanish or hide in one token: the model must be
//! BPE without a fused unknown token, the normalizer free of steps that delete text (strip,
//! accent stripping, replacements, control-character cleaning), and the pre-tokenizer free of
//! steps that drop whitespace. For any other tokenizer there is no bound (`None`).

use serde_json::Value;
use tokenizers::Tokenizer;

/// The most a Unicode normalization or case mapping shrinks UTF-8 text (3, rounded up).
const NORMALIZER_SHRINK: usize = 4;

/// `L·S` for `tokenizer`: every token stands for at most this many bytes of the input text.
/// `None` when the tokenizer allows no sound bound.
pub fn max_bytes_per_token(tokenizer: &Tokenizer) -> Option<usize> {
    let spec: Value = serde_json::from_str(&tokenizer.to_string(false).ok()?).ok()?;
    let model = spec.get("model")?;
    if model.get("type")?.as_str()? != "BPE" {
        return None;
    }
    let has_unk = model.get("unk_token").is_some_and(|u| !u.is_null());
    let byte_fallback = model.get("byte_fallback").and_then(Value::as_bool) == Some(true);
    let fuse_unk = model.get("fuse_unk").and_then(Value::as_bool) == Some(true);
    if has_unk && fuse_unk && !byte_fallback {
        return None; // a run of unknown characters of any length is one token
    }
    let shrink = normalizer_shrink(spec.get("normalizer").unwrap_or(&Value::Null))?;
    if !pre_tokenizer_keeps_text(spec.get("pre_tokenizer").unwrap_or(&Value::Null)) {
        return None;
    }
    let vocab = model.get("vocab")?.as_object()?;
    let longest_entry = vocab.keys().map(String::len).max().unwrap_or(0);
    let longest_added = spec
        .get("added_tokens")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|t| t.get("content").and_then(Value::as_str))
        .map(str::len)
        .chain(
            tokenizer
                .get_added_tokens_decoder()
                .values()
                .map(|t| t.content.len()),
        )
        .max()
        .unwrap_or(0);
    // An unknown character becomes one unknown token: at most 4 bytes.
    let longest = longest_entry.max(longest_added).max(4);
    Some(longest * shrink)
}

/// The most the normalizer shrinks text; `None` when it may delete text.
fn normalizer_shrink(n: &Value) -> Option<usize> {
    if n.is_null() {
        return Some(1);
    }
    match n.get("type")?.as_str()? {
        "NFC" | "NFD" | "NFKC" | "NFKD" | "Lowercase" => Some(NORMALIZER_SHRINK),
        "Prepend" | "ByteLevel" => Some(1),
        "Sequence" => {
            let mut total = 1usize;
            for step in n.get("normalizers")?.as_array()? {
                total = total.checked_mul(normalizer_shrink(step)?)?;
            }
            Some(total)
        }
        // A Replace of " " by "▁" (SentencePiece models) only grows the text.
        "Replace" => {
            let pattern = n.get("pattern")?.get("String")?.as_str()?;
            let content = n.get("content")?.as_str()?;
            (!pattern.is_empty() && content.len() >= pattern.len()).then_some(1)
        }
        _ => None, // Strip, StripAccents, BertNormalizer, Precompiled, regex replacements
    }
}

/// Whether the pre-tokenizer keeps every byte of the text (it only splits or maps).
fn pre_tokenizer_keeps_text(p: &Value) -> bool {
    if p.is_null() {
        return true;
    }
    match p.get("type").and_then(Value::as_str) {
        Some("ByteLevel" | "Metaspace" | "Digits" | "Punctuation" | "UnicodeScripts") => {
            p.get("behavior").and_then(Value::as_str) != Some("Removed")
        }
        Some("Split") => p.get("behavior").and_then(Value::as_str) != Some("Removed"),
        Some("Sequence") => p
            .get("pretokenizers")
            .and_then(Value::as_array)
            .is_some_and(|steps| steps.iter().all(pre_tokenizer_keeps_text)),
        _ => false, // Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit drop text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer(spec: Value) -> Tokenizer {
        Tokenizer::from_bytes(serde_json::to_vec(&spec).unwrap()).expect("a tokenizer")
    }

    fn bpe(normalizer: Value, pre: Value, vocab: Value) -> Value {
        serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": normalizer, "pre_tokenizer": pre, "post_processor": null,
            "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": []}
        })
    }

    #[test]
    fn byte_level_bpe_is_bounded_by_its_longest_entry() {
        let vocab = serde_json::json!({"a": 0, "b": 1, "aaaaaaaa": 2});
        let pre = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
            "trim_offsets": true, "use_regex": true});
        let t = tokenizer(bpe(Value::Null, pre.clone(), vocab.clone()));
        assert_eq!(max_bytes_per_token(&t), Some(8));
        let nfc = serde_json::json!({"type": "NFC"});
        let t = tokenizer(bpe(nfc, pre, vocab));
        assert_eq!(max_bytes_per_token(&t), Some(8 * NORMALIZER_SHRINK));
    }

    #[test]
    fn text_dropping_steps_give_no_bound() {
        let vocab = serde_json::json!({"a": 0});
        let ws = serde_json::json!({"type": "Whitespace"});
        assert_eq!(
            max_bytes_per_token(&tokenizer(bpe(Value::Null, ws, vocab.clone()))),
            None
        );
        let strip = serde_json::json!({"type": "Strip", "strip_left": true, "strip_right": true});
        assert_eq!(
            max_bytes_per_token(&tokenizer(bpe(strip, Value::Null, vocab))),
            None
        );
    }

    #[test]
    fn the_bound_never_exceeds_the_real_count() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/models");
        for name in ["chatml", "llama3", "parts"] {
            let model = crate::ModelText::load(name, &dir.join(name)).expect("loads");
            let per = max_bytes_per_token(model.tokenizer()).expect("byte-level BPE is bounded");
            for text in [
                "=".repeat(5000),
                "Hello, world! ".repeat(300),
                "가각".repeat(500),
                " ".repeat(3000),
                "\u{1100}\u{1161}\u{11a8}".repeat(200),
            ] {
                let n = model.encode(&text, false).expect("encodes").len();
                assert!(
                    text.len().div_ceil(per) <= n,
                    "{name}: {} bytes, {n} tokens",
                    text.len()
                );
            }
        }
    }
}
