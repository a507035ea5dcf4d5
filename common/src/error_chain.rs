//! An error and its causes on one line, `<error>: <cause>: <cause>`: the form of every error
//! line kvroute prints or sends (the binaries' last line, error replies, logs).

/// `error` and its causes on one line ([`join`]).
pub fn message(error: &anyhow::Error) -> String {
    join(error.chain().map(|cause| cause.to_string()))
}

/// A typed error and its causes on one line ([`join`]).
pub fn describe(error: &dyn std::error::Error) -> String {
    let mut texts = Vec::new();
    let mut cause = Some(error);
    while let Some(e) = cause {
        texts.push(e.to_string());
        cause = e.source();
    }
    join(texts.into_iter())
}

/// The causes joined by `: `; a cause whose text the line already holds is left out (a
/// wrapper that repeats its source's text), and line breaks inside a message become spaces.
fn join(causes: impl Iterator<Item = String>) -> String {
    let mut out = String::new();
    for cause in causes {
        let text = cause.split_whitespace().collect::<Vec<_>>().join(" ");
        if text.is_empty() || out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer {0}")]
    struct Outer(#[source] Inner);

    #[derive(Debug, thiserror::Error)]
    #[error("inner\n  detail")]
    struct Inner;

    #[derive(Debug, thiserror::Error)]
    #[error("same")]
    struct Repeats(#[source] Same);

    #[derive(Debug, thiserror::Error)]
    #[error("same")]
    struct Same;

    #[test]
    fn typed_and_anyhow_errors_read_alike() {
        assert_eq!(describe(&Outer(Inner)), "outer inner detail");
        let e = anyhow::Error::new(Inner).context("loading");
        assert_eq!(message(&e), "loading: inner detail");
        assert_eq!(describe(&Repeats(Same)), "same");
        let e = anyhow::Error::new(Outer(Inner)).context("");
        assert_eq!(message(&e), "outer inner detail");
    }
}
