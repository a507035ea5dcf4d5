//! Request classifiers: admission before worker selection. A classifier sees each request of
//! one (model, role) partition before it enters the admission queue and answers
//! [`Verdict::Admit`] with a [`Classification`] (class, due time, cost) or [`Verdict::Defer`];
//! it may set a soft worker preference on the request, and it learns from the host's
//! [`ClassifyEvent`]s. Pure: time comes in as `now_ms`, there is no I/O and no randomness.
//!
//! A provider (registered under a type name in the `RouterPluginRegistry`) validates the
//! `request_classifier.parameters` once at startup and returns a factory; the host calls the
//! factory once per partition, never per request.

mod context;
mod event;
pub mod max_in_flight;
pub mod pass_through;
mod progress;
mod request;
mod verdict;

use std::sync::Arc;

pub use context::{ClassifierWorker, RequestClassifierContext};
pub use event::{ClassifyEvent, Completion};
pub use progress::Progress;
pub use request::ClassifyRequest;
pub use verdict::{Classification, Verdict};

pub use crate::registry::ProviderError;
use crate::registry::{RegistryError, RouterPluginRegistry};

/// A classifier's `parameters:` mapping (strict serde, as for worker-selection policies).
pub type ClassifierParameters = crate::registry::PolicyParameters;

/// The type the host uses when no classifier is configured.
pub const PASS_THROUGH_TYPE: &str = "pass-through";

/// Admission for one (model, role) partition. The host calls it under the partition's
/// admission lock: keep `classify` and `on_event` short, without I/O or blocking.
pub trait RequestClassifier: Send {
    /// The type name, for logs.
    fn name(&self) -> &str;

    /// Admits or defers `request`. A deferred request is classified again (after each event
    /// and on the host's timer) until admitted or its queue deadline passes, so a `Defer` must
    /// leave the classifier's state as it was.
    fn classify(&mut self, request: &mut ClassifyRequest, now_ms: u64) -> Verdict;

    /// A lifecycle step of a request of this partition.
    fn on_event(&mut self, _event: &ClassifyEvent, _now_ms: u64) {}

    /// The partition's workers changed (registered, departed, capacity advertised).
    fn workers_changed(&mut self, _context: &RequestClassifierContext) {}
}

/// Builds a fresh classifier for one partition, from the partition's context at that time.
pub type RequestClassifierFactory =
    Arc<dyn Fn(&RequestClassifierContext) -> Box<dyn RequestClassifier> + Send + Sync>;

/// Validates a classifier's parameters (once, at startup) and returns its factory.
pub type RequestClassifierProvider = Arc<
    dyn Fn(&ClassifierParameters) -> Result<RequestClassifierFactory, ProviderError> + Send + Sync,
>;

/// Registers the built-in classifiers: `pass-through` and `max-in-flight`.
pub fn register_builtins(registry: &mut RouterPluginRegistry) -> Result<(), RegistryError> {
    registry.register_request_classifier(PASS_THROUGH_TYPE, Arc::new(pass_through::provider))?;
    registry
        .register_request_classifier(max_in_flight::TYPE_NAME, Arc::new(max_in_flight::provider))
}
