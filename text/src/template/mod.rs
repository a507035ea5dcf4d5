//! A compiled chat template and the Jinja environment transformers renders it in
//! (`_compile_jinja_template`): trim_blocks and lstrip_blocks, loop controls, jinja2's default
//! `Undefined` (prints empty, is falsy, iterates as empty; attribute access on it fails),
//! `raise_exception`, `strftime_now`, transformers' `tojson`, Python string / dict methods, and
//! values printed as Python prints them. Rendering is bounded by fuel (instructions) and an
//! output size.

mod content_format;
mod json;
mod methods;
mod pyfmt;
mod strftime;

use std::fmt;
use std::io;

use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind};

pub use content_format::ContentFormat;
pub(crate) use pyfmt::{is_py_space, py_strip};

use crate::TextError;

/// Bounds on one rendering, so a hostile message list cannot take unbounded CPU or memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Template instructions (minijinja fuel) per rendering. Default 50 million: seconds of
    /// CPU at most, far above what real chats on real templates use.
    pub fuel: u64,
    /// The largest rendered prompt, in bytes. Default 32 MiB.
    pub max_output_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            fuel: 50_000_000,
            max_output_bytes: 32 << 20,
        }
    }
}

/// One chat template, compiled, with what kvroute detects about it.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    content_format: ContentFormat,
    mentions_developer: bool,
    limits: Limits,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_bytes", &self.source.len())
            .field("content_format", &self.content_format)
            .field("limits", &self.limits)
            .finish()
    }
}

/// The error a template's `raise_exception(msg)` raised, found again in minijinja's error chain.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source` (a Jinja chat template as transformers takes it).
    pub fn compile(source: &str, limits: Limits) -> Result<ChatTemplate, TextError> {
        let mut env = environment();
        env.set_fuel(Some(limits.fuel));
        env.add_template_owned(NAME, rewrite_generation_tags(source))
            .map_err(|e| TextError::Template(describe(&e)))?;
        Ok(ChatTemplate {
            env,
            source: source.to_owned(),
            content_format: content_format::detect(source),
            mentions_developer: source.contains("\"developer\"") || source.contains("'developer'"),
            limits,
        })
    }

    /// The template's text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The content shape it expects (vLLM's detection).
    pub fn content_format(&self) -> ContentFormat {
        self.content_format
    }

    /// Whether it knows the `developer` role (vLLM's check: the quoted word appears in it).
    pub(crate) fn mentions_developer(&self) -> bool {
        self.mentions_developer
    }

    /// Renders with `ctx` (the template's variables).
    pub(crate) fn render(&self, ctx: Value) -> Result<String, TextError> {
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| TextError::Template(describe(&e)))?;
        let mut out = Bounded {
            buf: Vec::new(),
            max: self.limits.max_output_bytes,
            overflowed: false,
        };
        match template.render_captured_to(ctx, &mut out) {
            Ok(_) => String::from_utf8(out.buf)
                .map_err(|_| TextError::Template("the chat template wrote invalid UTF-8".into())),
            Err(_) if out.overflowed => Err(TextError::input(format!(
                "the rendered chat would exceed {} bytes",
                self.limits.max_output_bytes
            ))),
            Err(e) => Err(template_error(&e)),
        }
    }
}

/// The output buffer, refusing to grow past `max`.
struct Bounded {
    buf: Vec<u8>,
    max: usize,
    overflowed: bool,
}

impl io::Write for Bounded {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.len() + data.len() > self.max {
            self.overflowed = true;
            return Err(io::Error::other("output limit"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn template_error(e: &Error) -> TextError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(raised) = err.downcast_ref::<Raised>() {
            return TextError::Template(raised.0.clone());
        }
        source = err.source();
    }
    if e.kind() == ErrorKind::OutOfFuel {
        return TextError::input("the chat is too large to render (template step limit reached)");
    }
    TextError::Template(describe(e))
}

/// `chat template error: <what> (line N)`.
fn describe(e: &Error) -> String {
    let what = match e.detail() {
        Some(detail) => format!("{}: {detail}", e.kind()),
        None => e.kind().to_string(),
    };
    match e.line() {
        Some(line) => format!("chat template error: {what} (line {line})"),
        None => format!("chat template error: {what}"),
    }
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .expect("the default delimiters are valid");
    env.set_syntax(syntax);
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Lenient);
    env.set_unknown_method_callback(methods::call_method);
    env.set_formatter(|out, _state, value| {
        if value.is_undefined() || value.is_none() || value.as_str().is_some() {
            return minijinja::escape_formatter(out, _state, value);
        }
        let mut s = String::new();
        pyfmt::py_str(value, &mut s)?;
        out.write_str(&s).map_err(Error::from)
    });
    env.add_filter("tojson", json::tojson_filter);
    env.add_function(
        "raise_exception",
        |message: Value| -> Result<Value, Error> {
            let mut text = String::new();
            pyfmt::py_str(&message, &mut text)?;
            Err(Error::new(ErrorKind::InvalidOperation, text.clone()).with_source(Raised(text)))
        },
    );
    env.add_function("strftime_now", |format: String| {
        strftime::strftime_now(&format)
    });
    env
}

/// transformers' `{% generation %}…{% endgeneration %}` marks the assistant's text for its
/// token masks and otherwise renders its body in a scope of its own: `{% with %}` does the same.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(i) = rest.find("{%") {
        out.push_str(&rest[..i]);
        let tag = &rest[i..];
        let Some(end) = tag[2..].find("%}").map(|e| e + 2) else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let trimmed = inner
            .trim_start_matches(['-', '+'])
            .trim_end_matches(['-', '+'])
            .trim();
        let replacement = match trimmed {
            "generation" => Some("with"),
            "endgeneration" => Some("endwith"),
            _ => None,
        };
        match replacement {
            Some(word) => {
                out.push_str("{%");
                out.push_str(&inner.replacen(trimmed, word, 1));
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests;
