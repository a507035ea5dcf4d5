//! Which shape of message content a template expects, detected as vLLM detects it
//! (`_detect_content_format` in vllm/renderers/hf.py): `OpenAi` when the template loops over a
//! message's content (`{% for part in message['content'] %}`), else `String`.
//!
//! vLLM walks Jinja2's AST; this walks the template's tags with a small expression reader that
//! sees the same things: `set` assignments that alias `messages` (with slices and filters),
//! `for` loops over those, loops over `<message>.content` / `<message>['content']`, over a
//! variable named `content` outside macros, and over a macro parameter that a call passes
//! `<message>.content` to. Like vLLM, a template it cannot read counts as `String`.

/// The content shape the template is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// Content is a string: the text parts of a list are joined with `"\n"`.
    String,
    /// Content is a list of parts (`{"type": "text", "text": ...}`); a string becomes one part.
    OpenAi,
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Str(String),
    Num,
    Op(String),
}

fn is_ident(t: &Tok, name: &str) -> bool {
    matches!(t, Tok::Ident(s) if s == name)
}

fn is_op(t: &Tok, op: &str) -> bool {
    matches!(t, Tok::Op(s) if s == op)
}

/// A tag's tokens: `{% ... %}` statements and `{{ ... }}` expressions, in template order.
struct Tag {
    block: bool,
    toks: Vec<Tok>,
}

/// Splits the template into tags (skipping text, comments and raw blocks). `None` if a tag is
/// not closed.
fn tags(source: &str) -> Option<Vec<Tag>> {
    let mut out = Vec::new();
    let mut rest = source;
    let mut in_raw = false;
    while let Some(i) = rest.find('{') {
        let after = &rest[i + 1..];
        let (block, close) = match after.chars().next() {
            Some('%') => (true, "%}"),
            Some('{') => (false, "}}"),
            Some('#') => {
                let end = after.find("#}")?;
                rest = &after[end + 2..];
                continue;
            }
            _ => {
                rest = after;
                continue;
            }
        };
        let body = &after[1..];
        let (toks, len) = lex(body, close)?;
        rest = &body[len..];
        if in_raw {
            in_raw = !(block && toks.first().is_some_and(|t| is_ident(t, "endraw")));
            continue;
        }
        if block && toks.first().is_some_and(|t| is_ident(t, "raw")) {
            in_raw = true;
            continue;
        }
        out.push(Tag { block, toks });
    }
    Some(out)
}

/// Tokens up to `close` (outside string literals), and the bytes consumed including `close`.
fn lex(body: &str, close: &str) -> Option<(Vec<Tok>, usize)> {
    let bytes = body.as_bytes();
    let mut toks = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if body[i..].starts_with(close) {
            return Some((toks, i + close.len()));
        }
        // Whitespace control (`-`, `+`) next to the delimiters is not an operator.
        if (c == b'-' || c == b'+') && (i == 0 || body[i + 1..].starts_with(close)) {
            i += 1;
            continue;
        }
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                i += 1;
            }
            toks.push(Tok::Ident(body[start..i].to_owned()));
        } else if c.is_ascii_digit() {
            while i < bytes.len()
                && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'.' || bytes[i] == b'_')
            {
                i += 1;
            }
            toks.push(Tok::Num);
        } else if c == b'\'' || c == b'"' {
            let mut s = String::new();
            let mut chars = body[i + 1..].char_indices();
            loop {
                let (j, ch) = chars.next()?;
                if ch == '\\' {
                    let (_, esc) = chars.next()?;
                    s.push(esc);
                } else if ch as u32 == u32::from(c) {
                    i += 1 + j + 1;
                    break;
                } else {
                    s.push(ch);
                }
            }
            toks.push(Tok::Str(s));
        } else {
            let two = body.get(i..i + 2).unwrap_or("");
            let len = if ["==", "!=", "<=", ">=", "//", "**"].contains(&two) {
                2
            } else {
                1
            };
            let op = body.get(i..i + len)?;
            toks.push(Tok::Op(op.to_owned()));
            i += len;
        }
    }
    None
}

/// The part of an expression the detection looks at (vLLM's `_is_var_or_elems_access`).
#[derive(Debug)]
enum Node {
    Name(String),
    Attr(Box<Node>, String),
    Item(Box<Node>, Sub),
    Filter(Box<Node>),
    Test(Box<Node>),
    Other,
}

#[derive(Debug)]
enum Sub {
    Slice,
    Key(String),
    Other,
}

/// Index of the token closing the bracket opened at `open`.
fn closing(toks: &[Tok], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, t) in toks.iter().enumerate().skip(open) {
        match t {
            Tok::Op(o) if ["(", "[", "{"].contains(&o.as_str()) => depth += 1,
            Tok::Op(o) if [")", "]", "}"].contains(&o.as_str()) => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// Reads a whole expression as a chain of names, attributes, subscripts, filters, tests and
/// calls; anything else (operators, literals, conditionals) is `Other`.
fn parse(toks: &[Tok]) -> Node {
    let Some(first) = toks.first() else {
        return Node::Other;
    };
    let (mut node, mut i) = match first {
        Tok::Ident(name) => (Node::Name(name.clone()), 1),
        Tok::Op(o) if o == "(" => match closing(toks, 0) {
            Some(end) => (parse(&toks[1..end]), end + 1),
            None => return Node::Other,
        },
        _ => return Node::Other,
    };
    while i < toks.len() {
        match &toks[i] {
            Tok::Op(o) if o == "." => match toks.get(i + 1) {
                Some(Tok::Ident(attr)) => {
                    node = Node::Attr(Box::new(node), attr.clone());
                    i += 2;
                }
                _ => return Node::Other,
            },
            Tok::Op(o) if o == "[" => {
                let Some(end) = closing(toks, i) else {
                    return Node::Other;
                };
                let inner = &toks[i + 1..end];
                let sub = if inner.iter().any(|t| is_op(t, ":")) {
                    Sub::Slice
                } else if let [Tok::Str(k)] = inner {
                    Sub::Key(k.clone())
                } else {
                    Sub::Other
                };
                node = Node::Item(Box::new(node), sub);
                i = end + 1;
            }
            Tok::Op(o) if o == "(" => {
                let Some(end) = closing(toks, i) else {
                    return Node::Other;
                };
                node = Node::Other; // a call
                i = end + 1;
            }
            Tok::Op(o) if o == "|" => {
                if !matches!(toks.get(i + 1), Some(Tok::Ident(_))) {
                    return Node::Other;
                }
                i += 2;
                while is_op(toks.get(i).unwrap_or(&Tok::Num), ".") {
                    i += 2; // a dotted filter name
                }
                if toks.get(i).is_some_and(|t| is_op(t, "(")) {
                    let Some(end) = closing(toks, i) else {
                        return Node::Other;
                    };
                    i = end + 1;
                }
                node = Node::Filter(Box::new(node));
            }
            Tok::Ident(is) if is == "is" => {
                i += 1;
                if toks.get(i).is_some_and(|t| is_ident(t, "not")) {
                    i += 1;
                }
                if !matches!(toks.get(i), Some(Tok::Ident(_))) {
                    return Node::Other;
                }
                i += 1;
                match toks.get(i) {
                    Some(Tok::Op(o)) if o == "(" => {
                        let Some(end) = closing(toks, i) else {
                            return Node::Other;
                        };
                        i = end + 1;
                    }
                    Some(Tok::Str(_)) | Some(Tok::Num) => i += 1,
                    Some(Tok::Ident(w))
                        if !["and", "or", "else", "if", "is"].contains(&w.as_str()) =>
                    {
                        i += 1
                    }
                    _ => {}
                }
                node = Node::Test(Box::new(node));
            }
            _ => return Node::Other,
        }
    }
    node
}

/// vLLM's `_is_var_or_elems_access`: `var` (or `var.key` / `var['key']`), under any filters,
/// tests and slices.
fn is_access(node: &Node, var: &str, key: Option<&str>) -> bool {
    match node {
        Node::Filter(n) | Node::Test(n) | Node::Item(n, Sub::Slice) => is_access(n, var, key),
        _ => match key {
            None => matches!(node, Node::Name(n) if n == var),
            Some(key) => match node {
                Node::Attr(base, attr) | Node::Item(base, Sub::Key(attr)) => {
                    attr == key && matches!(&**base, Node::Name(n) if n == var)
                }
                _ => false,
            },
        },
    }
}

/// A `for` loop: its target (`None` for a tuple target), its iterable, and whether it sits
/// inside a macro (the macro's index).
struct ForLoop {
    target: Option<String>,
    iter: Node,
    in_macro: Option<usize>,
}

struct Macro {
    name: String,
    params: Vec<String>,
}

/// The format the template expects; `String` for a template this cannot read (as vLLM).
pub fn detect(source: &str) -> ContentFormat {
    detect_inner(source).unwrap_or(ContentFormat::String)
}

fn detect_inner(source: &str) -> Option<ContentFormat> {
    let tags = tags(source)?;
    let mut sets: Vec<(Option<String>, Node)> = Vec::new();
    let mut loops: Vec<ForLoop> = Vec::new();
    let mut macros: Vec<Macro> = Vec::new();
    let mut macro_stack: Vec<usize> = Vec::new();
    let mut calls: Vec<(String, Vec<Tok>)> = Vec::new();
    for tag in &tags {
        let t = &tag.toks;
        // Macro calls anywhere: NAME( args ) — kept for the macro-parameter rule.
        for (i, tok) in t.iter().enumerate() {
            if let (Tok::Ident(name), Some(Tok::Op(o))) = (tok, t.get(i + 1))
                && o == "("
                && !(i > 0 && is_op(&t[i - 1], "."))
                && let Some(end) = closing(t, i + 1)
            {
                calls.push((name.clone(), t[i + 2..end].to_vec()));
            }
        }
        if !tag.block {
            continue;
        }
        match t.first() {
            Some(Tok::Ident(kw)) if kw == "set" => {
                if let Some(eq) = t.iter().position(|x| is_op(x, "=")) {
                    let target = match &t[1..eq] {
                        [Tok::Ident(name)] => Some(name.clone()),
                        _ => None,
                    };
                    sets.push((target, parse(&t[eq + 1..])));
                }
            }
            Some(Tok::Ident(kw)) if kw == "for" => {
                let depth_zero_in = t.iter().position(|x| is_ident(x, "in"))?;
                let target = match &t[1..depth_zero_in] {
                    [Tok::Ident(name)] => Some(name.clone()),
                    _ => None,
                };
                let mut end = t.len();
                let mut depth = 0i32;
                for (i, x) in t.iter().enumerate().skip(depth_zero_in + 1) {
                    match x {
                        Tok::Op(o) if ["(", "[", "{"].contains(&o.as_str()) => depth += 1,
                        Tok::Op(o) if [")", "]", "}"].contains(&o.as_str()) => depth -= 1,
                        Tok::Ident(w) if depth == 0 && (w == "if" || w == "recursive") => {
                            end = i;
                            break;
                        }
                        _ => {}
                    }
                }
                let iter = parse(&t[depth_zero_in + 1..end]);
                loops.push(ForLoop {
                    target,
                    iter,
                    in_macro: macro_stack.last().copied(),
                });
            }
            Some(Tok::Ident(kw)) if kw == "macro" => {
                let Some(Tok::Ident(name)) = t.get(1) else {
                    return None;
                };
                let mut params = Vec::new();
                if t.get(2).is_some_and(|x| is_op(x, "(")) {
                    let end = closing(t, 2)?;
                    for arg in split_args(&t[3..end]) {
                        if let Some(Tok::Ident(p)) = arg.first() {
                            params.push(p.clone());
                        }
                    }
                }
                macros.push(Macro {
                    name: name.clone(),
                    params,
                });
                macro_stack.push(macros.len() - 1);
            }
            Some(Tok::Ident(kw)) if kw == "endmacro" => {
                macro_stack.pop();
            }
            _ => {}
        }
    }

    // Names that alias `messages` (vLLM's `_iter_nodes_assign_var_or_elems`, a BFS).
    let mut message_lists = vec!["messages".to_owned()];
    let mut next = 0;
    while next < message_lists.len() {
        let var = message_lists[next].clone();
        next += 1;
        for (target, rhs) in &sets {
            if is_access(rhs, &var, None) {
                let target = target.clone()?; // vLLM asserts a plain name here
                if !message_lists.contains(&target) {
                    message_lists.push(target);
                }
            }
        }
    }
    // Loop variables over those lists: the messages.
    let mut message_vars = Vec::new();
    for l in &loops {
        if message_lists.iter().any(|v| is_access(&l.iter, v, None)) {
            message_vars.push(l.target.clone()?);
        }
    }
    // Macro parameters that receive `<message>.content`.
    let is_content = |toks: &[Tok]| {
        let node = parse(toks);
        message_vars
            .iter()
            .any(|v| is_access(&node, v, Some("content")))
    };
    let mut content_params: Vec<Vec<String>> = vec![Vec::new(); macros.len()];
    for (m, params) in macros.iter().zip(content_params.iter_mut()) {
        for (name, args) in &calls {
            if name != &m.name {
                continue;
            }
            for (i, arg) in split_args(args).iter().enumerate() {
                match arg.as_slice() {
                    [Tok::Ident(k), Tok::Op(eq), value @ ..] if eq == "=" => {
                        if m.params.contains(k) && is_content(value) {
                            params.push(k.clone());
                        }
                    }
                    value => {
                        if i < m.params.len() && is_content(value) {
                            params.push(m.params[i].clone());
                        }
                    }
                }
            }
        }
    }
    for l in &loops {
        if message_vars
            .iter()
            .any(|v| is_access(&l.iter, v, Some("content")))
        {
            l.target.as_ref()?;
            return Some(ContentFormat::OpenAi);
        }
        let Node::Name(iter_name) = &l.iter else {
            continue;
        };
        let via_param = l
            .in_macro
            .is_some_and(|m| content_params[m].contains(iter_name));
        if via_param || (l.in_macro.is_none() && iter_name == "content") {
            l.target.as_ref()?;
            return Some(ContentFormat::OpenAi);
        }
    }
    Some(ContentFormat::String)
}

/// Splits call arguments at top-level commas.
fn split_args(toks: &[Tok]) -> Vec<Vec<Tok>> {
    let mut out = vec![Vec::new()];
    let mut depth = 0i32;
    for t in toks {
        match t {
            Tok::Op(o) if ["(", "[", "{"].contains(&o.as_str()) => depth += 1,
            Tok::Op(o) if [")", "]", "}"].contains(&o.as_str()) => depth -= 1,
            Tok::Op(o) if o == "," && depth == 0 => {
                out.push(Vec::new());
                continue;
            }
            _ => {}
        }
        if let Some(last) = out.last_mut() {
            last.push(t.clone());
        }
    }
    out.retain(|a| !a.is_empty());
    out
}

#[cfg(test)]
mod tests;
