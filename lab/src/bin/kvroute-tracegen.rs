//! `kvroute-tracegen`: writes a seeded multi-turn session trace in Mooncake's format, with
//! `session_id` and `turn` per row (see `kvroute_lab::tracegen`). Errors end it with one
//! line and a status of kvroute's exit table (`kvroute_common::ops::exit`).

use std::process::ExitCode;

use anyhow::Context as _;
use kvroute_common::ops::exit;
use kvroute_lab::tracegen::{TracegenArgs, generate, write_trace};

fn main() -> ExitCode {
    exit::run("kvroute-tracegen", |args: TracegenArgs, origins| {
        args.validate().map_err(|e| origins.attribute(e))?;
        let trace = generate(&args.params);
        write_trace(&trace, &args.out).with_context(|| format!("writing {}", args.out.display()))
    })
}
