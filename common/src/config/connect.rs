//! Connecting to NATS and etcd at startup, one way for both: each attempt that fails for a
//! reason that may pass (refused, timed out, DNS) is logged with the URLs and retried after a
//! backoff (100 ms doubling to 2 s) until the deadline — `--nats-connect-timeout-ms`,
//! `--etcd-connect-timeout-ms` — has passed; then [`Unreachable`] names the flag and the
//! URLs (the binaries exit with status 4). A refusal that will not pass (bad credentials,
//! TLS) stops at once.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::Context as _;

use super::{EtcdArgs, NatsArgs};
use crate::ops::exit::{Status, describe, with_status};

/// The default startup deadline of both connections.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 30_000;

/// Longest wait of one connection attempt (and of a NATS reconnect attempt later on).
const MAX_ATTEMPT: Duration = Duration::from_secs(5);
/// etcd requests after startup time out after this long.
const ETCD_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// NATS or etcd did not answer before the startup deadline.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{service} at {urls} unreachable: gave up after {attempts} attempts in {deadline_ms} ms (--{flag}); last error: {last}"
)]
pub struct Unreachable {
    /// `NATS` or `etcd`.
    pub service: &'static str,
    pub urls: String,
    /// The deadline's flag, without dashes.
    pub flag: &'static str,
    pub deadline_ms: u64,
    pub attempts: u32,
    pub last: String,
}

/// How one attempt failed.
enum Attempt {
    /// May pass: try again until the deadline.
    Retry(String),
    /// Will not pass: give up now.
    Stop(anyhow::Error),
}

/// The wait after the `n`th failed attempt (1-based): 100 ms, doubling, at most 2 s.
pub(crate) fn backoff(n: u32) -> Duration {
    let ms = 100u64.saturating_mul(1 << n.saturating_sub(1).min(5));
    Duration::from_millis(ms.min(2000))
}

/// Runs `attempt` until it succeeds, stops, or `deadline` has passed since the first try.
async fn retry_until<T, Fut>(
    service: &'static str,
    urls: &str,
    flag: &'static str,
    deadline: Duration,
    mut attempt: impl FnMut() -> Fut,
) -> anyhow::Result<T>
where
    Fut: Future<Output = Result<T, Attempt>>,
{
    let start = Instant::now();
    let mut attempts = 0;
    let mut last = String::new();
    loop {
        attempts += 1;
        let remaining = deadline.saturating_sub(start.elapsed());
        last = match tokio::time::timeout(remaining.min(MAX_ATTEMPT), attempt()).await {
            Ok(Ok(value)) => {
                if attempts > 1 {
                    tracing::info!(service, urls, attempts, "connected");
                }
                return Ok(value);
            }
            Ok(Err(Attempt::Stop(e))) => return Err(e),
            Ok(Err(Attempt::Retry(reason))) => reason,
            // Cut short by the deadline: the previous attempt's reason says more.
            Err(_) if !last.is_empty() => last,
            Err(_) => "timed out".to_owned(),
        };
        let remaining = deadline.saturating_sub(start.elapsed());
        if remaining.is_zero() {
            return Err(Unreachable {
                service,
                urls: urls.to_owned(),
                flag,
                deadline_ms: deadline.as_millis() as u64,
                attempts,
                last,
            }
            .into());
        }
        let wait = backoff(attempts).min(remaining);
        tracing::warn!(
            service,
            urls,
            attempt = attempts,
            retry_in_ms = wait.as_millis() as u64,
            error = %last,
            "{service} unreachable; retrying until --{flag}"
        );
        tokio::time::sleep(wait).await;
    }
}

impl NatsArgs {
    /// Connects (retrying until `--nats-connect-timeout-ms`); `name` identifies the process to
    /// the server. Reconnects forever afterwards; connection events are logged.
    pub async fn connect(&self, name: &str) -> anyhow::Result<async_nats::Client> {
        self.connect_with(name, None).await
    }

    /// [`NatsArgs::connect`], also sending every connection event (`Disconnected`,
    /// `Connected`, ...) on the returned channel: for state that must be reconciled after a
    /// gap in what the connection delivered.
    pub async fn connect_observed(
        &self,
        name: &str,
    ) -> anyhow::Result<(
        async_nats::Client,
        tokio::sync::mpsc::UnboundedReceiver<async_nats::Event>,
    )> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        Ok((self.connect_with(name, Some(tx)).await?, rx))
    }

    async fn connect_with(
        &self,
        name: &str,
        events: Option<tokio::sync::mpsc::UnboundedSender<async_nats::Event>>,
    ) -> anyhow::Result<async_nats::Client> {
        self.validate()?;
        let urls: Vec<async_nats::ServerAddr> = self
            .urls
            .iter()
            .map(|u| u.parse())
            .collect::<Result<_, _>>()
            .context("parsing --nats-url")?;
        let joined = self.urls.join(",");
        let deadline = Duration::from_millis(self.connect_timeout_ms);
        retry_until("NATS", &joined, "nats-connect-timeout-ms", deadline, || {
            let urls = urls.clone();
            let events = events.clone();
            let joined = joined.clone();
            async move {
                let opts = self
                    .options(name, deadline, events)
                    .await
                    .map_err(Attempt::Stop)?;
                opts.connect(urls).await.map_err(|e| {
                    use async_nats::ConnectErrorKind as K;
                    let refused = |check: String| {
                        Attempt::Stop(with_status(
                            Status::BadConfig,
                            anyhow::anyhow!(
                                "NATS at {joined} refused the connection (check {check}): {}",
                                describe(&e)
                            ),
                        ))
                    };
                    match e.kind() {
                        K::Tls => refused(self.tls_flags()),
                        K::Authentication | K::AuthorizationViolation | K::ServerParse => {
                            refused("--nats-user, --nats-token, --nats-creds".to_owned())
                        }
                        _ => Attempt::Retry(describe(&e)),
                    }
                })
            }
        })
        .await
    }

    async fn options(
        &self,
        name: &str,
        deadline: Duration,
        events: Option<tokio::sync::mpsc::UnboundedSender<async_nats::Event>>,
    ) -> anyhow::Result<async_nats::ConnectOptions> {
        let mut opts = async_nats::ConnectOptions::new()
            .name(name)
            .connection_timeout(deadline.min(MAX_ATTEMPT))
            .ping_interval(Duration::from_millis(self.ping_interval_ms))
            .max_reconnects(None)
            .custom_inbox_prefix(&self.inbox_prefix)
            .event_callback(move |event| {
                match &event {
                    async_nats::Event::Connected => {
                        tracing::info!("NATS connection (re)established")
                    }
                    async_nats::Event::Disconnected => {
                        tracing::warn!("NATS connection lost; reconnecting")
                    }
                    async_nats::Event::Closed => tracing::info!("NATS connection closed"),
                    other => tracing::warn!(event = %other, "NATS connection event"),
                }
                if let Some(tx) = &events {
                    let _ = tx.send(event);
                }
                async {}
            });
        if let Some((user, password)) = self.credentials.pair() {
            opts = opts.user_and_password(user.to_owned(), password.to_owned());
        }
        if let Some(token) = &self.token {
            opts = opts.token(token.clone());
        }
        if let Some(creds) = &self.creds_file {
            opts = opts.credentials_file(creds).await.map_err(|e| {
                with_status(
                    Status::BadConfig,
                    anyhow::anyhow!("--nats-creds {}: {e}", creds.display()),
                )
            })?;
        }
        if let Some(ca) = &self.tls.ca {
            opts = opts.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let Some((cert, key)) = self.tls.identity() {
            opts = opts.add_client_certificate(cert.clone(), key.clone());
        }
        Ok(opts)
    }

    /// The TLS flags to check after a failed handshake, with their values.
    fn tls_flags(&self) -> String {
        tls_flags("nats", &self.tls)
    }
}

/// `--<service>-tls-ca <path>` (and the client certificate's flags when set), or the hint to
/// set `--<service>-tls-ca` when TLS is not configured.
fn tls_flags<S: super::Service>(service: &str, tls: &super::TlsFiles<S>) -> String {
    let mut flags = Vec::new();
    match &tls.ca {
        Some(ca) => flags.push(format!("--{service}-tls-ca {}", ca.display())),
        None => flags.push(format!(
            "--{service}-tls-ca: not set, the system's roots are used"
        )),
    }
    if let Some((cert, key)) = tls.identity() {
        flags.push(format!(
            "--{service}-tls-cert {}, --{service}-tls-key {}",
            cert.display(),
            key.display()
        ));
    }
    flags.join(", ")
}

impl EtcdArgs {
    /// Connects and checks that etcd answers (retrying until `--etcd-connect-timeout-ms`).
    /// Requests afterwards time out after 5 s.
    pub async fn connect(&self) -> anyhow::Result<etcd_client::Client> {
        self.validate()?;
        let mut opts = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_millis(self.connect_timeout_ms).min(MAX_ATTEMPT))
            .with_timeout(ETCD_REQUEST_TIMEOUT)
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(5));
        if let Some((user, password)) = self.credentials.pair() {
            opts = opts.with_user(user.to_owned(), password.to_owned());
        }
        if self.tls.enabled() {
            let mut tls = etcd_client::TlsOptions::new();
            if let Some(ca) = &self.tls.ca {
                tls = tls.ca_certificate(etcd_client::Certificate::from_pem(read(ca)?));
            }
            if let Some((cert, key)) = self.tls.identity() {
                tls = tls.identity(etcd_client::Identity::from_pem(read(cert)?, read(key)?));
            }
            opts = opts.with_tls(tls);
        }
        let joined = self.endpoints.join(",");
        let deadline = Duration::from_millis(self.connect_timeout_ms);
        retry_until("etcd", &joined, "etcd-connect-timeout-ms", deadline, || {
            let opts = opts.clone();
            let joined = joined.clone();
            async move {
                let refused = |e: etcd_client::Error| {
                    use etcd_client::Error as E;
                    let permanent = matches!(&e, E::GRpcStatus(s) if matches!(
                        s.code(),
                        tonic::Code::Unauthenticated
                            | tonic::Code::PermissionDenied
                            | tonic::Code::InvalidArgument
                    )) || matches!(&e, E::InvalidArgs(_) | E::InvalidUri(_));
                    let reason = etcd_reason(&e);
                    if is_certificate_error(&reason) {
                        return Attempt::Stop(with_status(
                            Status::BadConfig,
                            anyhow::anyhow!(
                                "etcd at {joined}: TLS handshake failed (check {}): {reason}",
                                tls_flags("etcd", &self.tls)
                            ),
                        ));
                    }
                    if permanent {
                        Attempt::Stop(with_status(
                            Status::BadConfig,
                            anyhow::anyhow!(
                                "etcd at {joined} refused the connection (check --etcd-user, --etcd-password, --etcd-tls-*): {reason}"
                            ),
                        ))
                    } else {
                        Attempt::Retry(reason)
                    }
                };
                // The client connects lazily: a status request shows etcd answers.
                let mut client = etcd_client::Client::connect(&self.endpoints, Some(opts))
                    .await
                    .map_err(refused)?;
                client.status().await.map_err(refused)?;
                Ok(client)
            }
        })
        .await
    }
}

/// An etcd error in words: a gRPC status's message and its deepest cause (tonic's own
/// display repeats the whole chain in debug form).
fn etcd_reason(e: &etcd_client::Error) -> String {
    let etcd_client::Error::GRpcStatus(status) = e else {
        return describe(e);
    };
    let mut deepest: Option<&dyn std::error::Error> = None;
    let mut source = std::error::Error::source(status);
    while let Some(s) = source {
        deepest = Some(s);
        source = s.source();
    }
    match deepest {
        Some(cause) => format!("{}: {cause}", status.message()),
        None => status.message().to_owned(),
    }
}

/// Whether an etcd transport error is a TLS verification failure (tonic reports those as a
/// transport error whose deepest cause is rustls's), which no retry mends.
fn is_certificate_error(reason: &str) -> bool {
    let reason = reason.to_lowercase();
    ["certificate", "unknownissuer", "handshake", "tls"]
        .iter()
        .any(|word| reason.contains(word))
}

fn read(path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_2_s() {
        let waits: Vec<u64> = (1..=7).map(|n| backoff(n).as_millis() as u64).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1600, 2000, 2000]);
    }

    #[tokio::test]
    async fn retries_until_the_deadline_then_names_flag_and_urls() {
        let started = Instant::now();
        let mut tries = 0;
        let err = retry_until(
            "NATS",
            "nats://127.0.0.1:1",
            "nats-connect-timeout-ms",
            Duration::from_millis(450),
            || {
                tries += 1;
                async { Err::<(), _>(Attempt::Retry("connection refused".into())) }
            },
        )
        .await
        .unwrap_err();
        let elapsed = started.elapsed();
        assert!(elapsed >= Duration::from_millis(450), "{elapsed:?}");
        assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
        // 0, 100, 300 ms, then the last wait is cut to the deadline.
        assert_eq!(tries, 4);
        let unreachable = err.downcast_ref::<Unreachable>().unwrap();
        assert_eq!(unreachable.attempts, 4);
        let text = err.to_string();
        assert!(text.contains("nats://127.0.0.1:1"), "{text}");
        assert!(text.contains("--nats-connect-timeout-ms"), "{text}");
        assert!(text.contains("connection refused"), "{text}");
    }

    #[tokio::test]
    async fn a_permanent_refusal_stops_at_once() {
        let err = retry_until(
            "etcd",
            "x",
            "etcd-connect-timeout-ms",
            Duration::from_secs(5),
            || async { Err::<(), _>(Attempt::Stop(anyhow::anyhow!("bad password"))) },
        )
        .await
        .unwrap_err();
        assert_eq!(err.to_string(), "bad password");
    }
}
