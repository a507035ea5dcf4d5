//! `pass-through`: admits every request with its default classification; what the host does
//! when no classifier is configured.

use std::sync::Arc;

use super::{
    Classification, ClassifierParameters, ClassifyRequest, PASS_THROUGH_TYPE, ProviderError,
    RequestClassifier, RequestClassifierFactory, Verdict,
};

/// Always [`Verdict::Admit`] with [`Classification::default_for`].
#[derive(Debug, Default, Clone, Copy)]
pub struct PassThrough;

impl RequestClassifier for PassThrough {
    fn name(&self) -> &str {
        PASS_THROUGH_TYPE
    }

    fn classify(&mut self, request: &mut ClassifyRequest, _now_ms: u64) -> Verdict {
        Verdict::Admit(Classification::default_for(request))
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Parameters {}

/// Takes no parameters.
pub fn provider(
    parameters: &ClassifierParameters,
) -> Result<RequestClassifierFactory, ProviderError> {
    let Parameters {} = parameters.deserialize()?;
    Ok(Arc::new(|_context| Box::new(PassThrough)))
}

#[cfg(test)]
mod tests {
    use kvroute_common::messages::WorkerRole;
    use uuid::Uuid;

    use super::*;
    use crate::classify::RequestClassifierContext;

    #[test]
    fn admits_everything_with_the_default_and_refuses_parameters() {
        let factory = provider(&ClassifierParameters::default()).unwrap();
        let mut classifier = factory(&RequestClassifierContext::default());
        let mut request = ClassifyRequest::new(Uuid::nil(), "m", WorkerRole::Aggregated, 8, 900)
            .with_priority_jump_ms(100);
        assert_eq!(
            classifier.classify(&mut request, 1_000),
            Verdict::Admit(Classification {
                class: 0,
                due_ms: 800,
                cost: 1
            })
        );
        assert_eq!(classifier.name(), "pass-through");
        let err = provider(&ClassifierParameters::from_yaml("limit: 1").unwrap())
            .err()
            .unwrap();
        assert!(err.message.contains("unknown parameter `limit`"), "{err}");
    }
}
