//! What NATS and etcd settings share: a user name with its password, and the TLS files (CA,
//! client certificate and key). One struct each, flattened into [`super::NatsArgs`] and
//! [`super::EtcdArgs`]; the [`Service`] parameter gives each copy its flag names and
//! environment variables (`--nats-tls-ca` / `KVROUTE_NATS_TLS_CA`, `--etcd-tls-ca` / ...).

use std::marker::PhantomData;
use std::path::PathBuf;

use clap::{Arg, ArgMatches, Command};

use super::{ConfigError, file_must_exist, pair_must_match};

/// The flag ids (which are also the long flags) and environment variables of one service.
#[derive(Debug)]
pub struct AccessFlags {
    pub user: (&'static str, &'static str),
    pub password: (&'static str, &'static str),
    pub tls_ca: (&'static str, &'static str),
    pub tls_cert: (&'static str, &'static str),
    pub tls_key: (&'static str, &'static str),
}

/// A server kvroute connects to, naming its access flags.
pub trait Service: Clone + std::fmt::Debug + Send + Sync + 'static {
    /// `NATS` or `etcd`, in help texts.
    const NAME: &'static str;
    const FLAGS: AccessFlags;
}

/// NATS's access flags.
#[derive(Debug, Clone)]
pub struct Nats;

impl Service for Nats {
    const NAME: &'static str = "NATS";
    const FLAGS: AccessFlags = AccessFlags {
        user: ("nats-user", "KVROUTE_NATS_USER"),
        password: ("nats-password", "KVROUTE_NATS_PASSWORD"),
        tls_ca: ("nats-tls-ca", "KVROUTE_NATS_TLS_CA"),
        tls_cert: ("nats-tls-cert", "KVROUTE_NATS_TLS_CERT"),
        tls_key: ("nats-tls-key", "KVROUTE_NATS_TLS_KEY"),
    };
}

/// etcd's access flags.
#[derive(Debug, Clone)]
pub struct Etcd;

impl Service for Etcd {
    const NAME: &'static str = "etcd";
    const FLAGS: AccessFlags = AccessFlags {
        user: ("etcd-user", "KVROUTE_ETCD_USER"),
        password: ("etcd-password", "KVROUTE_ETCD_PASSWORD"),
        tls_ca: ("etcd-tls-ca", "KVROUTE_ETCD_TLS_CA"),
        tls_cert: ("etcd-tls-cert", "KVROUTE_ETCD_TLS_CERT"),
        tls_key: ("etcd-tls-key", "KVROUTE_ETCD_TLS_KEY"),
    };
}

fn arg(flag: (&'static str, &'static str), help: String) -> Arg {
    Arg::new(flag.0).long(flag.0).env(flag.1).help(help)
}

/// `--<service>-user` and `--<service>-password`: both or neither.
#[derive(Debug, Clone)]
pub struct Credentials<S> {
    pub user: Option<String>,
    pub password: Option<String>,
    service: PhantomData<S>,
}

impl<S> Default for Credentials<S> {
    fn default() -> Self {
        Self {
            user: None,
            password: None,
            service: PhantomData,
        }
    }
}

impl<S: Service> Credentials<S> {
    pub fn new(user: impl Into<String>, password: impl Into<String>) -> Self {
        Self {
            user: Some(user.into()),
            password: Some(password.into()),
            service: PhantomData,
        }
    }

    /// The pair, when both are set.
    pub fn pair(&self) -> Option<(&str, &str)> {
        Some((self.user.as_deref()?, self.password.as_deref()?))
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        pair_must_match(
            (S::FLAGS.user.0, self.user.is_some()),
            (S::FLAGS.password.0, self.password.is_some()),
        )
    }
}

impl<S: Service> clap::FromArgMatches for Credentials<S> {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut s = Self::default();
        s.update_from_arg_matches(m)?;
        Ok(s)
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        self.user = m.get_one::<String>(S::FLAGS.user.0).cloned();
        self.password = m.get_one::<String>(S::FLAGS.password.0).cloned();
        Ok(())
    }
}

impl<S: Service> clap::Args for Credentials<S> {
    fn augment_args(cmd: Command) -> Command {
        let (user, password) = (S::FLAGS.user, S::FLAGS.password);
        cmd.arg(arg(
            user,
            format!("{} user name (with --{})", S::NAME, password.0),
        ))
        .arg(
            arg(
                password,
                format!("{} password (with --{})", S::NAME, user.0),
            )
            .hide_env_values(true),
        )
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

/// `--<service>-tls-ca` (verify the server; implies TLS) and the client certificate and key
/// for mutual TLS (both or neither).
#[derive(Debug, Clone)]
pub struct TlsFiles<S> {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    service: PhantomData<S>,
}

impl<S> Default for TlsFiles<S> {
    fn default() -> Self {
        Self {
            ca: None,
            cert: None,
            key: None,
            service: PhantomData,
        }
    }
}

impl<S: Service> TlsFiles<S> {
    /// Verify the server with the CA certificate at `ca` (no client certificate).
    pub fn with_ca(ca: impl Into<PathBuf>) -> Self {
        Self {
            ca: Some(ca.into()),
            ..Self::default()
        }
    }

    /// Whether any TLS setting is given.
    pub fn enabled(&self) -> bool {
        self.ca.is_some() || self.cert.is_some()
    }

    /// The client certificate and key, when both are set.
    pub fn identity(&self) -> Option<(&PathBuf, &PathBuf)> {
        Some((self.cert.as_ref()?, self.key.as_ref()?))
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let f = S::FLAGS;
        file_must_exist(f.tls_ca.0, &self.ca)?;
        file_must_exist(f.tls_cert.0, &self.cert)?;
        file_must_exist(f.tls_key.0, &self.key)?;
        pair_must_match(
            (f.tls_cert.0, self.cert.is_some()),
            (f.tls_key.0, self.key.is_some()),
        )
    }
}

impl<S: Service> clap::FromArgMatches for TlsFiles<S> {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut s = Self::default();
        s.update_from_arg_matches(m)?;
        Ok(s)
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        let f = S::FLAGS;
        self.ca = m.get_one::<PathBuf>(f.tls_ca.0).cloned();
        self.cert = m.get_one::<PathBuf>(f.tls_cert.0).cloned();
        self.key = m.get_one::<PathBuf>(f.tls_key.0).cloned();
        Ok(())
    }
}

impl<S: Service> clap::Args for TlsFiles<S> {
    fn augment_args(cmd: Command) -> Command {
        let f = S::FLAGS;
        let path = || clap::value_parser!(PathBuf);
        cmd.arg(
            arg(
                f.tls_ca,
                format!(
                    "CA certificate (PEM) to verify the {} server; implies TLS",
                    S::NAME
                ),
            )
            .value_parser(path()),
        )
        .arg(
            arg(
                f.tls_cert,
                format!(
                    "Client certificate (PEM) for mutual TLS (with --{})",
                    f.tls_key.0
                ),
            )
            .value_parser(path()),
        )
        .arg(
            arg(
                f.tls_key,
                format!(
                    "Client private key (PEM) for mutual TLS (with --{})",
                    f.tls_cert.0
                ),
            )
            .value_parser(path()),
        )
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}
