//! Where a role's policy selection came from: named in startup errors and logs.

use std::fmt;

/// Where a role's selection came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectionSource {
    RoleFlag,
    Env,
    Yaml,
    BuiltIn,
}

impl fmt::Display for SelectionSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SelectionSource::RoleFlag => "role flag",
            SelectionSource::Env => "KVROUTE_WORKER_SELECTION_POLICY",
            SelectionSource::Yaml => "YAML",
            SelectionSource::BuiltIn => "built-in",
        })
    }
}
