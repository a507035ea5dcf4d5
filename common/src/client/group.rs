//! Request/reply to a replicated service (a queue group whose members also listen on direct
//! subjects) under a [`RetryPolicy`]: every attempt carries its own deadline and waits at most
//! its timeout; a retry goes to the replica that answered last (see [`super::retry`]). The
//! caller builds each attempt's payload and judges each answer.

use std::sync::Mutex;
use std::time::Duration;

use async_nats::client::RequestErrorKind;
use bytes::Bytes;

use super::retry::{RetryPolicy, Target, target};
use crate::messages::now_ms;

/// What the caller makes of an answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Judged<T> {
    /// The answer: a success, or an error no other replica would change.
    Answer(T),
    /// An answer another replica may improve on (not ready, failed internally): try again;
    /// if no attempt does better, this is the result.
    Retry(T),
}

/// A judged answer, with who gave it and how many attempts it took.
#[derive(Debug, Clone, PartialEq)]
pub struct Answered<T> {
    pub value: T,
    /// Attempts sent (1 = no retry).
    pub attempts: u32,
    /// The replica that answered, when the answer names it.
    pub responder: Option<String>,
}

/// No answer at all after every attempt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupError {
    /// Nobody was listening, on every attempt.
    #[error("no replica is listening (after {attempts} attempts)")]
    NoResponders { attempts: u32 },
    /// The last attempt timed out (earlier ones timed out or found nobody).
    #[error("no answer after {attempts} attempts ({waited:?})")]
    TimedOut { attempts: u32, waited: Duration },
    /// The request could not be built or sent.
    #[error("{0}")]
    Transport(String),
}

/// A client of one replicated service.
#[derive(Debug)]
pub struct GroupClient {
    nats: async_nats::Client,
    group_subject: String,
    /// Builds a replica's direct subject from its id.
    direct_subject: fn(&crate::Names, &str) -> String,
    names: crate::Names,
    policy: RetryPolicy,
    last_good: Mutex<Option<String>>,
}

impl GroupClient {
    /// Requests go to `group_subject`; a retry to `direct_subject(names, replica_id)`.
    pub fn new(
        nats: async_nats::Client,
        names: &crate::Names,
        group_subject: String,
        direct_subject: fn(&crate::Names, &str) -> String,
        policy: RetryPolicy,
    ) -> Self {
        Self {
            nats,
            group_subject,
            direct_subject,
            names: names.clone(),
            policy,
            last_good: Mutex::new(None),
        }
    }

    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// The replica that answered most recently, if any.
    pub fn last_good(&self) -> Option<String> {
        self.last_good
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set_last_good(&self, id: &str) {
        let mut last = self.last_good.lock().unwrap_or_else(|p| p.into_inner());
        if last.as_deref() != Some(id) {
            *last = Some(id.to_owned());
        }
    }

    /// Forgets `id` as the last good replica (it failed a request).
    fn suspect(&self, id: &str) {
        let mut last = self.last_good.lock().unwrap_or_else(|p| p.into_inner());
        if last.as_deref() == Some(id) {
            *last = None;
        }
    }

    /// Sends attempts until one is answered with a [`Judged::Answer`] or the policy's
    /// attempts are spent. `payload(attempt, deadline_ms)` builds each attempt (stamping its
    /// number and deadline); `judge` decodes an answer into a verdict and the responder's id.
    pub async fn request<T>(
        &self,
        mut payload: impl FnMut(u32, u64) -> Result<Bytes, String>,
        mut judge: impl FnMut(&[u8]) -> (Judged<T>, Option<String>),
    ) -> Result<Answered<T>, GroupError> {
        let started = tokio::time::Instant::now();
        let mut failed: Vec<String> = Vec::new();
        let mut retryable: Option<Answered<T>> = None;
        let mut only_no_responders = true;
        let mut last_error = None;
        for attempt in 0..self.policy.attempts {
            let last_good = self.last_good();
            let (subject, direct) = match target(attempt, last_good.as_deref(), &failed) {
                Target::Group => (self.group_subject.clone(), None),
                Target::Replica(id) => {
                    ((self.direct_subject)(&self.names, id), Some(id.to_owned()))
                }
            };
            let timeout = self.policy.timeout(attempt);
            let deadline_ms = now_ms().saturating_add(timeout.as_millis() as u64);
            let body = payload(attempt, deadline_ms).map_err(GroupError::Transport)?;
            let request = async_nats::Request::new()
                .payload(body)
                .timeout(Some(timeout));
            match self.nats.send_request(subject, request).await {
                Ok(msg) => {
                    let (verdict, responder) = judge(&msg.payload);
                    match verdict {
                        Judged::Answer(value) => {
                            if let Some(id) = &responder {
                                self.set_last_good(id);
                            }
                            return Ok(Answered {
                                value,
                                attempts: attempt + 1,
                                responder,
                            });
                        }
                        Judged::Retry(value) => {
                            only_no_responders = false;
                            if let Some(id) = responder.clone().or(direct) {
                                self.suspect(&id);
                                failed.push(id);
                            }
                            retryable = Some(Answered {
                                value,
                                attempts: attempt + 1,
                                responder,
                            });
                        }
                    }
                }
                Err(e) => {
                    let to_group = direct.is_none();
                    if let Some(id) = direct {
                        self.suspect(&id);
                        failed.push(id);
                    }
                    match e.kind() {
                        RequestErrorKind::NoResponders => {
                            // Nobody in the group: replicas may be restarting or stepping
                            // out; pause before the next attempt.
                            if to_group && attempt + 1 < self.policy.attempts {
                                tokio::time::sleep(self.policy.no_responders_backoff).await;
                            }
                        }
                        RequestErrorKind::TimedOut => {
                            only_no_responders = false;
                            last_error = Some(GroupError::TimedOut {
                                attempts: attempt + 1,
                                waited: started.elapsed(),
                            });
                        }
                        _ => {
                            only_no_responders = false;
                            last_error = Some(GroupError::Transport(e.to_string()));
                        }
                    }
                }
            }
        }
        if let Some(answer) = retryable {
            return Ok(answer);
        }
        let attempts = self.policy.attempts;
        Err(if only_no_responders {
            GroupError::NoResponders { attempts }
        } else {
            last_error.unwrap_or(GroupError::TimedOut {
                attempts,
                waited: started.elapsed(),
            })
        })
    }
}
