//! `kvroute-tracegen`'s settings: the shape of the sessions ([`SessionTraceParams`], checked by
//! [`SessionTraceParams::validate`]) and where the trace goes.

use std::path::PathBuf;

use kvroute_common::config::ConfigError;
use kvroute_common::trace::TRACE_BLOCK_TOKENS;

use super::range::TokenRange;

/// The longest conversation a parameter set may produce, in tokens.
pub const MAX_SESSION_TOKENS: u64 = 4_000_000;

/// What a session trace looks like. Every field has a unit and a default; ranges are `N` or
/// `MIN-MAX` (inclusive, drawn uniformly).
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct SessionTraceParams {
    /// Sessions (conversations) in the trace.
    #[arg(long, env = "KVROUTE_TRACEGEN_SESSIONS", default_value_t = 200)]
    pub sessions: u32,
    /// Turns (requests) per session, drawn per session.
    #[arg(long, env = "KVROUTE_TRACEGEN_TURNS", default_value = "4-8")]
    pub turns: TokenRange,
    /// System-prompt templates shared across sessions; each session starts with one, drawn
    /// uniformly. 0: sessions share nothing.
    #[arg(long, env = "KVROUTE_TRACEGEN_TEMPLATES", default_value_t = 8)]
    pub templates: u32,
    /// Length of each template in 512-token trace blocks, drawn per template.
    #[arg(long, env = "KVROUTE_TRACEGEN_TEMPLATE_BLOCKS", default_value = "4")]
    pub template_blocks: TokenRange,
    /// Tokens of each user message, drawn per turn.
    #[arg(long, env = "KVROUTE_TRACEGEN_USER_TOKENS", default_value = "50-800")]
    pub user_tokens: TokenRange,
    /// Tokens of each assistant reply (the turn's `output_length`, then part of the
    /// conversation the next turn resends), drawn per turn.
    #[arg(long, env = "KVROUTE_TRACEGEN_REPLY_TOKENS", default_value = "100-500")]
    pub reply_tokens: TokenRange,
    /// Mean seconds a user takes to answer after the reply (exponentially distributed).
    #[arg(long, env = "KVROUTE_TRACEGEN_THINK_TIME_SECS", default_value_t = 10.0)]
    pub think_time_secs: f64,
    /// Assumed milliseconds per reply token before the user sees the whole reply: the next
    /// turn comes `reply tokens × this + think time` after the previous one (the trace does
    /// not know how fast the fleet serves).
    #[arg(
        long,
        env = "KVROUTE_TRACEGEN_REPLY_MS_PER_TOKEN",
        default_value_t = 20.0
    )]
    pub reply_ms_per_token: f64,
    /// New sessions per second (Poisson arrivals).
    #[arg(long, env = "KVROUTE_TRACEGEN_SESSION_RATE", default_value_t = 1.0)]
    pub session_rate: f64,
    /// Sessions that start together in each burst, on top of the Poisson arrivals (they
    /// count towards --sessions). 0: no bursts.
    #[arg(long, env = "KVROUTE_TRACEGEN_BURST_SESSIONS", default_value_t = 0)]
    pub burst_sessions: u32,
    /// Seconds between bursts (the first comes this long after the start).
    #[arg(
        long,
        env = "KVROUTE_TRACEGEN_BURST_INTERVAL_SECS",
        default_value_t = 60.0
    )]
    pub burst_interval_secs: f64,
    /// LoRA adapters the sessions use (`adapter-1` … `adapter-N`, each row's `lora_name`); each
    /// session draws one, by popularity (--adapter-zipf). 0: every session uses the base
    /// model.
    #[arg(long, env = "KVROUTE_TRACEGEN_ADAPTERS", default_value_t = 0)]
    pub adapters: u32,
    /// Skew of the adapters' popularity: adapter k is drawn with weight 1 / k^s (0: uniform;
    /// 1: Zipf's law, the most popular about N/ln(N) times the median's share).
    #[arg(long, env = "KVROUTE_TRACEGEN_ADAPTER_ZIPF", default_value_t = 1.0)]
    pub adapter_zipf: f64,
    /// Seed of every draw: the same parameters and seed give the same trace.
    #[arg(long, env = "KVROUTE_TRACEGEN_SEED", default_value_t = 1)]
    pub seed: u64,
}

impl Default for SessionTraceParams {
    fn default() -> Self {
        Self {
            sessions: 200,
            turns: TokenRange::new(4, 8),
            templates: 8,
            template_blocks: TokenRange::new(4, 4),
            user_tokens: TokenRange::new(50, 800),
            reply_tokens: TokenRange::new(100, 500),
            think_time_secs: 10.0,
            reply_ms_per_token: 20.0,
            session_rate: 1.0,
            burst_sessions: 0,
            burst_interval_secs: 60.0,
            adapters: 0,
            adapter_zipf: 1.0,
            seed: 1,
        }
    }
}

impl SessionTraceParams {
    /// Checks every setting; the error names the flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=1_000_000).contains(&self.sessions) {
            return Err(ConfigError::new("sessions", "must be 1..=1000000"));
        }
        let at_least_one = |field: &'static str, r: TokenRange| {
            if r.min == 0 {
                Err(ConfigError::new(field, format!("{r}: must be at least 1")))
            } else {
                Ok(())
            }
        };
        at_least_one("turns", self.turns)?;
        if self.turns.max > 10_000 {
            return Err(ConfigError::new("turns", "at most 10000 turns per session"));
        }
        if self.adapters > 100_000 {
            return Err(ConfigError::new("adapters", "must be 0..=100000"));
        }
        if !(self.adapter_zipf.is_finite() && (0.0..=10.0).contains(&self.adapter_zipf)) {
            return Err(ConfigError::new(
                "adapter-zipf",
                format!("must be a number in [0, 10], got {}", self.adapter_zipf),
            ));
        }
        if self.templates > 100_000 {
            return Err(ConfigError::new("templates", "must be 0..=100000"));
        }
        if self.templates > 0 {
            at_least_one("template-blocks", self.template_blocks)?;
        }
        at_least_one("user-tokens", self.user_tokens)?;
        at_least_one("reply-tokens", self.reply_tokens)?;
        let longest = u64::from(self.template_blocks.max) * TRACE_BLOCK_TOKENS as u64
            + u64::from(self.turns.max)
                * (u64::from(self.user_tokens.max) + u64::from(self.reply_tokens.max));
        if longest > MAX_SESSION_TOKENS {
            return Err(ConfigError::new(
                "turns",
                format!(
                    "a session could reach {longest} tokens (template + turns × (user + reply \
                     tokens)), above {MAX_SESSION_TOKENS}"
                ),
            ));
        }
        let seconds = [
            ("think-time-secs", self.think_time_secs, false),
            ("reply-ms-per-token", self.reply_ms_per_token, false),
            ("session-rate", self.session_rate, true),
            ("burst-interval-secs", self.burst_interval_secs, true),
        ];
        for (field, value, positive) in seconds {
            let ok = (0.0..1e9).contains(&value) && (!positive || value > 0.0);
            if !ok {
                let range = if positive { "> 0" } else { "≥ 0" };
                return Err(ConfigError::new(
                    field,
                    format!("must be a finite number {range}, got {value}"),
                ));
            }
        }
        Ok(())
    }
}

/// Writes a seeded multi-turn session trace in Mooncake's JSONL format, each row with its
/// `session_id` and `turn` (and with --adapters, its session's LoRA adapter as `lora_name`):
/// every turn's prompt is its session's template, the conversation so far (earlier user
/// messages and replies) and the new user message.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "kvroute-tracegen", version)]
pub struct TracegenArgs {
    /// Where to write the trace (`-`: standard output).
    #[arg(long, short, env = "KVROUTE_TRACEGEN_OUT", default_value = "-")]
    pub out: PathBuf,
    #[command(flatten)]
    pub params: SessionTraceParams,
}

impl TracegenArgs {
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.params.validate()
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn parse(args: &[&str]) -> TracegenArgs {
        let mut all = vec!["kvroute-tracegen"];
        all.extend_from_slice(args);
        TracegenArgs::try_parse_from(all).unwrap()
    }

    #[test]
    fn the_defaults_are_valid_and_match_default() {
        let a = parse(&[]);
        a.validate().unwrap();
        assert_eq!(a.params, SessionTraceParams::default());
        assert_eq!(a.out, PathBuf::from("-"));
        let a = parse(&["--turns", "2", "--user-tokens", "10-20", "--templates", "0"]);
        assert_eq!(a.params.turns, TokenRange::new(2, 2));
        assert_eq!(a.params.user_tokens, TokenRange::new(10, 20));
        a.validate().unwrap();
    }

    #[test]
    fn validation_names_the_flag() {
        let field = |args: &[&str]| parse(args).validate().unwrap_err().field;
        assert_eq!(field(&["--sessions", "0"]), "sessions");
        assert_eq!(field(&["--adapters", "100001"]), "adapters");
        assert_eq!(field(&["--adapter-zipf=-1"]), "adapter-zipf");
        assert_eq!(field(&["--adapter-zipf", "inf"]), "adapter-zipf");
        parse(&["--adapters", "20", "--adapter-zipf", "0"])
            .validate()
            .unwrap();
        assert_eq!(field(&["--turns", "0-3"]), "turns");
        assert_eq!(
            field(&["--turns", "5000", "--user-tokens", "1000"]),
            "turns"
        );
        assert_eq!(field(&["--template-blocks", "0"]), "template-blocks");
        assert_eq!(field(&["--user-tokens", "0-10"]), "user-tokens");
        assert_eq!(field(&["--reply-tokens", "0"]), "reply-tokens");
        assert_eq!(field(&["--think-time-secs=-1"]), "think-time-secs");
        assert_eq!(
            field(&["--reply-ms-per-token", "NaN"]),
            "reply-ms-per-token"
        );
        assert_eq!(field(&["--session-rate", "0"]), "session-rate");
        assert_eq!(
            field(&["--burst-interval-secs", "0"]),
            "burst-interval-secs"
        );
        // No templates: their length does not matter.
        parse(&["--templates", "0", "--template-blocks", "0"])
            .validate()
            .unwrap();
        // A range that is not one names the flag through clap.
        let err = TracegenArgs::try_parse_from(["kvroute-tracegen", "--turns", "8-4"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--turns") && err.contains("MIN is above MAX"),
            "{err}"
        );
    }
}
