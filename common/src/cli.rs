//! Command-line parsing for kvroute's binaries: clap, with the conventions every binary shares.
//!
//! - An empty (or blank) environment variable means unset: the flag's default applies.
//! - Every flag that takes a value also takes one that looks like a negative number
//!   (`--max-in-flight -5`), so the error is about the value and names the flag.
//! - Boolean flags and variables take `1`, `0`, `true` or `false`.
//! - A bad value is reported in one line naming where it came from: the flag
//!   (`--max-in-flight -5: must not be negative`) or the environment variable
//!   (`KVROUTE_MAX_IN_FLIGHT="abc" (for --max-in-flight): not a whole number`).
//! - [`Origins`] records where each flag's value came from, so errors found later
//!   (validation, policy selection) can name the variable rather than the flag.
//!
//! Only binaries call [`parse`]; it looks at the process's arguments and environment, as clap
//! itself does.

use std::collections::BTreeMap;
use std::ffi::OsString;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Command};

use crate::config::ConfigError;

/// Where a flag's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    CommandLine,
    /// The environment variable of that name.
    Env(String),
    Default,
}

/// Where each flag's value came from, by flag name (without the dashes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Origins {
    flags: BTreeMap<String, Origin>,
}

impl Origins {
    /// Origins given directly (tests, embedders).
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, Origin)>) -> Self {
        Self {
            flags: pairs
                .into_iter()
                .map(|(flag, origin)| (flag.to_owned(), origin))
                .collect(),
        }
    }

    fn from_matches(cmd: &Command, matches: &ArgMatches) -> Self {
        let mut flags = BTreeMap::new();
        for arg in cmd.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            let origin = match matches.value_source(arg.get_id().as_str()) {
                Some(ValueSource::CommandLine) => Origin::CommandLine,
                Some(ValueSource::EnvVariable) => match arg.get_env() {
                    Some(name) => Origin::Env(name.to_string_lossy().into_owned()),
                    None => Origin::CommandLine,
                },
                _ => Origin::Default,
            };
            flags.insert(long.to_owned(), origin);
        }
        Self { flags }
    }

    /// Where `flag`'s value came from (`None`: not a flag of this command, or not recorded).
    pub fn get(&self, flag: &str) -> Option<&Origin> {
        self.flags.get(flag)
    }

    /// The environment variable `flag`'s value came from, if it came from one.
    pub fn env(&self, flag: &str) -> Option<&str> {
        match self.flags.get(flag) {
            Some(Origin::Env(name)) => Some(name),
            _ => None,
        }
    }

    /// How to name where `flag`'s value came from: the variable (`KVROUTE_DECODE_POLICY`)
    /// when it came from the environment, else the flag (`--decode-policy`).
    pub fn label(&self, flag: &str) -> String {
        match self.env(flag) {
            Some(name) => name.to_owned(),
            None => format!("--{flag}"),
        }
    }

    /// `error`, naming the environment variable when the bad value came from one.
    pub fn attribute(&self, mut error: ConfigError) -> ConfigError {
        if error.env.is_none() {
            error.env = self.env(error.field).map(str::to_owned);
        }
        error
    }
}

/// Why a command line does not run.
#[derive(Debug)]
pub enum CliError {
    /// `--help` or `--version`: print it and exit 0.
    Display(clap::Error),
    /// Bad usage: the one-line message (exit 2).
    Usage(String),
}

/// Parses the process's command line (and environment) into `T`.
pub fn parse<T: clap::Parser>() -> Result<(T, Origins), CliError> {
    parse_from(std::env::args_os())
}

/// Parses `args` (the first is the program name) and the process's environment into `T`.
pub fn parse_from<T: clap::Parser>(
    args: impl IntoIterator<Item = impl Into<OsString>>,
) -> Result<(T, Origins), CliError> {
    parse_command(T::command(), args)
}

/// [`parse_from`] with `command` (`T`'s own, adjusted: a binary's name, extra help).
pub fn parse_command<T: clap::FromArgMatches>(
    command: Command,
    args: impl IntoIterator<Item = impl Into<OsString>>,
) -> Result<(T, Origins), CliError> {
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let mut cmd = conventions(command);
    let matches = cmd
        .try_get_matches_from_mut(args.clone())
        .map_err(|e| classify(&cmd, e, &args))?;
    let parsed = T::from_arg_matches(&matches).map_err(|e| classify(&cmd, e, &args))?;
    Ok((parsed, Origins::from_matches(&cmd, &matches)))
}

/// kvroute's conventions applied to every argument of `cmd`.
pub fn conventions(cmd: Command) -> Command {
    cmd.mut_args(|mut arg| {
        if let Some(name) = arg.get_env()
            && std::env::var_os(name).is_some_and(|v| v.to_string_lossy().trim().is_empty())
        {
            arg = arg.env(None::<&'static str>);
        }
        let boolean = matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse)
            || arg.get_value_parser().type_id() == std::any::TypeId::of::<bool>();
        if boolean {
            arg = arg.value_parser(clap::builder::ValueParser::new(parse_bool));
        }
        if arg.get_action().takes_values() {
            arg = arg.allow_negative_numbers(true);
        }
        arg
    })
}

/// A boolean value: `1`, `0`, `true` or `false` (any case).
pub fn parse_bool(value: &str) -> Result<bool, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" => Ok(true),
        "0" | "false" => Ok(false),
        _ => Err("expected 1, 0, true or false".into()),
    }
}

fn classify(cmd: &Command, error: clap::Error, args: &[OsString]) -> CliError {
    match error.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => CliError::Display(error),
        _ => CliError::Usage(usage_message(cmd, &error, args)),
    }
}

/// One line for a clap error: a bad value names its flag or variable; anything else is
/// clap's own first line, with its tip.
fn usage_message(cmd: &Command, error: &clap::Error, args: &[OsString]) -> String {
    let context = |kind| match error.get(kind) {
        Some(ContextValue::String(s)) => Some(s.clone()),
        _ => None,
    };
    if let (ErrorKind::ValueValidation | ErrorKind::InvalidValue, Some(arg), Some(value)) = (
        error.kind(),
        context(ContextKind::InvalidArg),
        context(ContextKind::InvalidValue),
    ) {
        let flag = arg.split([' ', '=']).next().unwrap_or(&arg).to_owned();
        let reason = match error.kind() {
            ErrorKind::InvalidValue => match error.get(ContextKind::ValidValue) {
                Some(ContextValue::Strings(valid)) => {
                    format!("expected one of {}", valid.join(", "))
                }
                _ => "not one of the accepted values".into(),
            },
            _ => value_reason(error, &value),
        };
        let found = cmd
            .get_arguments()
            .find(|a| a.get_long().is_some_and(|l| flag == format!("--{l}")));
        let env = found
            .and_then(|a| a.get_env())
            .map(|e| e.to_string_lossy().into_owned());
        // Secrets (passwords, tokens) are not echoed.
        let shown = match found {
            Some(a) if a.is_hide_env_values_set() => "<hidden>".to_owned(),
            _ => format!("{value:?}"),
        };
        let on_command_line = args.iter().skip(1).any(|a| {
            let a = a.to_string_lossy();
            a == flag || a.starts_with(&format!("{flag}="))
        });
        return match env {
            Some(env) if !on_command_line => {
                format!("invalid configuration: {env}={shown} (for {flag}): {reason}")
            }
            _ => format!("invalid configuration: {flag} {value}: {reason}"),
        };
    }
    let rendered = error.render().to_string();
    let mut lines = rendered.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or("bad usage");
    let first = first.strip_prefix("error: ").unwrap_or(first);
    let tip = lines
        .find_map(|l| l.strip_prefix("tip: "))
        .map(|t| format!(" ({t})"))
        .unwrap_or_default();
    format!("{first}{tip}; see --help")
}

/// Why a value did not parse, in words (a negative number for an unsigned flag says so).
fn value_reason(error: &clap::Error, value: &str) -> String {
    use std::error::Error as _;
    let Some(source) = error.source() else {
        return "invalid value".into();
    };
    if let Some(e) = source.downcast_ref::<std::num::ParseIntError>() {
        use std::num::IntErrorKind;
        let negative = value.trim().starts_with('-') && value.trim().parse::<f64>().is_ok();
        return match e.kind() {
            _ if negative => "must not be negative".into(),
            IntErrorKind::Empty => "must not be empty".into(),
            IntErrorKind::PosOverflow | IntErrorKind::NegOverflow => "too large".into(),
            _ => "not a whole number".into(),
        };
    }
    // clap's ranged integer parsers: "-1 is not in 0..=4294967295".
    let text = source.to_string();
    if let Some((_, range)) = text.split_once(" is not in ")
        && let Some((low, high)) = range.split_once("..=")
    {
        let negative = value.trim().starts_with('-');
        return if negative && low == "0" {
            "must not be negative".into()
        } else {
            format!("must be between {low} and {high}")
        };
    }
    if source.is::<std::num::ParseFloatError>() {
        return "not a number".into();
    }
    if source.is::<std::net::AddrParseError>() {
        return "not an address (expected host:port, e.g. 127.0.0.1:9200)".into();
    }
    text
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Args {
        #[arg(long = "max-in-flight", default_value_t = 4)]
        max_in_flight: usize,
        #[arg(long = "workers", default_value_t = 2)]
        workers: u32,
        #[arg(long = "ratio", default_value_t = 0.5)]
        ratio: f64,
        #[arg(long = "purge-log", default_value_t = true, action = ArgAction::Set)]
        purge_log: bool,
        #[arg(long = "random-ids")]
        random_ids: bool,
        /// `PATH` is set (and not a number) wherever tests run.
        #[arg(long = "from-path", env = "PATH")]
        from_path: Option<u32>,
        #[arg(long = "name")]
        name: Option<String>,
    }

    fn usage(args: &[&str]) -> String {
        match parse_from::<Args>(std::iter::once("x").chain(args.iter().copied())) {
            Err(CliError::Usage(message)) => message,
            other => panic!("{args:?}: {other:?}"),
        }
    }

    fn ok(args: &[&str]) -> (Args, Origins) {
        let mut all = vec!["x", "--from-path", "1"];
        all.extend_from_slice(args);
        match parse_from::<Args>(all) {
            Ok(parsed) => parsed,
            Err(e) => panic!("{args:?}: {e:?}"),
        }
    }

    #[test]
    fn a_negative_value_is_a_range_error_naming_the_flag() {
        let message = usage(&["--from-path", "1", "--max-in-flight", "-5"]);
        assert_eq!(
            message,
            "invalid configuration: --max-in-flight -5: must not be negative"
        );
        let message = usage(&["--from-path", "1", "--max-in-flight=abc"]);
        assert_eq!(
            message,
            "invalid configuration: --max-in-flight abc: not a whole number"
        );
        // u32 goes through clap's ranged parser, usize through FromStr: the same words.
        let message = usage(&["--from-path", "1", "--workers", "-1"]);
        assert_eq!(
            message,
            "invalid configuration: --workers -1: must not be negative"
        );
        let message = usage(&["--from-path", "1", "--workers", "99999999999"]);
        assert_eq!(
            message,
            "invalid configuration: --workers 99999999999: must be between 0 and 4294967295"
        );
        assert_eq!(ok(&["--ratio", "-0.5"]).0.ratio, -0.5);
        assert_eq!(ok(&["--name", "-3"]).0.name.as_deref(), Some("-3"));
    }

    #[test]
    fn a_bad_environment_value_names_the_variable() {
        let message = usage(&[]);
        assert!(
            message.starts_with("invalid configuration: PATH=\"")
                && message.ends_with("(for --from-path): not a whole number"),
            "{message}"
        );
        // Given on the command line, the flag is named instead.
        let message = usage(&["--from-path", "x"]);
        assert_eq!(
            message,
            "invalid configuration: --from-path x: not a whole number"
        );
    }

    #[test]
    fn booleans_take_1_0_true_false() {
        assert!(!ok(&["--purge-log", "0"]).0.purge_log);
        assert!(ok(&["--purge-log", "TRUE"]).0.purge_log);
        assert!(!ok(&["--purge-log", "false"]).0.purge_log);
        assert!(ok(&["--random-ids"]).0.random_ids);
        assert!(!ok(&[]).0.random_ids);
        let message = usage(&["--from-path", "1", "--purge-log", "yes please"]);
        assert_eq!(
            message,
            "invalid configuration: --purge-log yes please: expected 1, 0, true or false"
        );
    }

    #[test]
    fn origins_say_where_each_value_came_from() {
        let (_, origins) = ok(&["--ratio", "1"]);
        assert_eq!(origins.get("ratio"), Some(&Origin::CommandLine));
        assert_eq!(origins.get("max-in-flight"), Some(&Origin::Default));
        assert_eq!(origins.label("ratio"), "--ratio");
        let env =
            Origins::from_pairs([("decode-policy", Origin::Env("KVROUTE_DECODE_POLICY".into()))]);
        assert_eq!(env.label("decode-policy"), "KVROUTE_DECODE_POLICY");
        let error = env.attribute(ConfigError::new("decode-policy", "bad"));
        assert_eq!(
            error.to_string(),
            "invalid configuration: KVROUTE_DECODE_POLICY (for --decode-policy): bad"
        );
    }

    #[test]
    fn other_usage_errors_are_one_line() {
        let message = usage(&["--from-path", "1", "--max-in-fligh", "3"]);
        assert!(!message.contains('\n'), "{message}");
        assert!(message.contains("--max-in-fligh"), "{message}");
        assert!(message.ends_with("see --help"), "{message}");
        assert!(matches!(
            parse_from::<Args>(["x", "--help"]),
            Err(CliError::Display(_))
        ));
    }
}
