//! Registry and configuration: precedence, startup errors that name the culprit, factories.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvroute_common::messages::WorkerRole;

use super::*;
use crate::policies::round_robin::RoundRobinPicker;

fn resolve(yaml: &str, overrides: &PolicyOverrides) -> Result<ResolvedPolicies, ConfigError> {
    let config = match yaml {
        "" => WorkerSelectionConfig::default(),
        yaml => WorkerSelectionConfig::from_yaml(yaml)?,
    };
    RouterPluginRegistry::with_builtins().resolve(&config, overrides)
}

fn flag(name: &str, origin: &str) -> Option<Override> {
    Some(Override::new(name, origin))
}

const TWO_INSTANCES: &str = "
worker_selection:
  aggregated: rr
  prefill: lb
  decode: lb
  instances:
    - name: rr
      type: round-robin
    - name: lb
      type: least-busy
      parameters:
        metric: decode_blocks
";

#[test]
fn without_configuration_every_role_uses_the_built_in() {
    let resolved = resolve("", &PolicyOverrides::default()).unwrap();
    for role in WorkerRole::ALL {
        let selection = resolved.selection(role);
        assert_eq!(selection.instance, "default");
        assert_eq!(selection.source, SelectionSource::BuiltIn);
        assert_eq!(resolved.build(role, "m").unwrap().name(), "default");
    }
}

#[test]
fn precedence_is_role_flag_then_env_then_yaml_then_built_in() {
    let yaml_only = resolve(TWO_INSTANCES, &PolicyOverrides::default()).unwrap();
    assert_eq!(yaml_only.selection(WorkerRole::Aggregated).instance, "rr");
    assert_eq!(yaml_only.selection(WorkerRole::Decode).instance, "lb");
    assert_eq!(
        yaml_only.selection(WorkerRole::Encode).instance,
        "default",
        "an omitted role does not fall back to another role"
    );

    let env = PolicyOverrides {
        all_roles: flag("rr", "KVROUTE_WORKER_SELECTION_POLICY"),
        ..Default::default()
    };
    let with_env = resolve(TWO_INSTANCES, &env).unwrap();
    for role in WorkerRole::ALL {
        assert_eq!(with_env.selection(role).instance, "rr");
        assert_eq!(with_env.selection(role).source, SelectionSource::Env);
    }

    let flags = PolicyOverrides {
        prefill: flag("lb", "--prefill-policy"),
        decode: flag("default", "--decode-policy"),
        all_roles: flag("rr", "--worker-selection-policy"),
    };
    let with_flags = resolve(TWO_INSTANCES, &flags).unwrap();
    assert_eq!(with_flags.selection(WorkerRole::Prefill).instance, "lb");
    assert_eq!(
        with_flags.selection(WorkerRole::Prefill).source,
        SelectionSource::RoleFlag
    );
    assert_eq!(with_flags.selection(WorkerRole::Decode).instance, "default");
    assert_eq!(with_flags.selection(WorkerRole::Aggregated).instance, "rr");
    // `/status` and the startup log say exactly where each selection came from.
    let origins = WorkerRole::ALL.map(|role| with_flags.selection(role).origin.clone());
    assert_eq!(
        origins,
        WorkerRole::ALL.map(|role| match role {
            WorkerRole::Prefill => "--prefill-policy".to_owned(),
            WorkerRole::Decode => "--decode-policy".to_owned(),
            _ => "--worker-selection-policy".to_owned(),
        })
    );
    assert_eq!(
        with_env.selection(WorkerRole::Decode).origin,
        "KVROUTE_WORKER_SELECTION_POLICY"
    );
    assert_eq!(
        yaml_only.selection(WorkerRole::Decode).origin,
        "worker_selection.decode"
    );
    let decode = with_flags.build(WorkerRole::Decode, "m").unwrap();
    assert_eq!(decode.name(), "default");
}

#[test]
fn a_selection_may_name_a_registered_type_directly() {
    let env = PolicyOverrides {
        all_roles: flag("power-of-two", "--worker-selection-policy"),
        ..Default::default()
    };
    let resolved = resolve("", &env).unwrap();
    let policy = resolved.build(WorkerRole::Aggregated, "m").unwrap();
    assert_eq!(policy.name(), "power-of-two");
}

#[test]
fn an_unknown_type_stops_startup_naming_it() {
    let err = resolve(
        "worker_selection:\n  instances:\n    - name: mine\n      type: least-bussy\n",
        &PolicyOverrides::default(),
    )
    .unwrap_err();
    assert!(matches!(err, ConfigError::UnknownType { .. }));
    let text = err.to_string();
    assert!(
        text.contains("least-bussy") && text.contains("mine"),
        "{text}"
    );
    assert!(
        text.contains("least-busy"),
        "lists the registered types: {text}"
    );
}

#[test]
fn a_duplicate_instance_name_stops_startup() {
    let err = resolve(
        "worker_selection:\n  instances:\n    - {name: a, type: random}\n    - {name: a, type: round-robin}\n",
        &PolicyOverrides::default(),
    )
    .unwrap_err();
    assert_eq!(err, ConfigError::DuplicateInstance { name: "a".into() });
    assert!(err.to_string().contains("\"a\""));
    let reserved = resolve(
        "worker_selection:\n  instances:\n    - {name: default, type: random}\n",
        &PolicyOverrides::default(),
    )
    .unwrap_err();
    assert!(matches!(reserved, ConfigError::ReservedInstanceName { .. }));
}

#[test]
fn invalid_parameters_stop_startup_even_for_unused_instances() {
    let err = resolve(
        "worker_selection:\n  instances:\n    - name: hot\n      type: default\n      parameters: {temperature: -2}\n",
        &PolicyOverrides::default(),
    )
    .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, ConfigError::InvalidParameters { .. }));
    assert!(
        text.contains("hot") && text.contains("temperature"),
        "{text}"
    );
    let unknown_field = resolve(
        "worker_selection:\n  instances:\n    - name: lb\n      type: least-busy\n      parameters: {metrc: decode_blocks}\n",
        &PolicyOverrides::default(),
    )
    .unwrap_err();
    assert!(
        unknown_field.to_string().contains("metrc"),
        "{unknown_field}"
    );
}

#[test]
fn a_selection_naming_nothing_stops_startup_naming_where_it_came_from() {
    let flags = PolicyOverrides {
        decode: flag("nope", "--decode-policy"),
        ..Default::default()
    };
    let err = resolve(TWO_INSTANCES, &flags).unwrap_err();
    assert!(
        matches!(&err, ConfigError::UnknownSelection { role: WorkerRole::Decode, name, origin, kind: SelectionSource::RoleFlag, .. }
            if name == "nope" && origin == "--decode-policy"),
        "{err:?}"
    );
    assert!(!err.in_file());
    let text = err.to_string();
    assert!(text.contains("(from --decode-policy)"), "{text}");
    assert!(
        text.contains("registered: default, device-aware-weighted, least-busy"),
        "{text}"
    );

    // The same from the environment names the variable, for every role it applies to.
    let env = PolicyOverrides {
        decode: flag("bogus", "KVROUTE_DECODE_POLICY"),
        all_roles: flag("bogus", "KVROUTE_WORKER_SELECTION_POLICY"),
        ..Default::default()
    };
    let text = resolve("", &env).unwrap_err().to_string();
    assert!(
        text.contains("(from KVROUTE_WORKER_SELECTION_POLICY)")
            || text.contains("(from KVROUTE_DECODE_POLICY)"),
        "{text}"
    );
    let decode_only = PolicyOverrides {
        decode: flag("bogus", "KVROUTE_DECODE_POLICY"),
        ..Default::default()
    };
    let text = resolve("", &decode_only).unwrap_err().to_string();
    assert!(
        text.starts_with("decode selection \"bogus\" (from KVROUTE_DECODE_POLICY)"),
        "{text}"
    );

    // A YAML selection names its key, and counts as the file's error.
    let err = resolve(
        "worker_selection:\n  prefill: gone\n",
        &PolicyOverrides::default(),
    )
    .unwrap_err();
    assert!(err.in_file());
    assert!(
        err.to_string().contains("(from worker_selection.prefill)"),
        "{err}"
    );
}

/// A type whose `limit` parameter is required.
fn registry_with_a_type_needing_parameters() -> RouterPluginRegistry {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Params {
        #[allow(dead_code)]
        limit: u32,
    }
    let mut registry = RouterPluginRegistry::with_builtins();
    registry
        .register_worker_selection(
            "needs-limit",
            Arc::new(|params: &PolicyParameters| {
                params.deserialize::<Params>()?;
                let factory: PolicyFactory = Arc::new(|_: &PolicyBuildContext<'_>| {
                    Ok(WorkerSelectionPolicy::new(
                        Vec::new(),
                        Box::new(RoundRobinPicker::default()),
                    ))
                });
                Ok(factory)
            }),
        )
        .unwrap();
    registry
}

#[test]
fn a_request_naming_a_type_that_needs_parameters_is_told_which() {
    let registry = registry_with_a_type_needing_parameters();
    let resolved = registry
        .resolve(
            &WorkerSelectionConfig::default(),
            &PolicyOverrides::default(),
        )
        .unwrap();
    let err = resolved
        .build_named("needs-limit", WorkerRole::Aggregated, "m")
        .expect("a registered type is known")
        .unwrap_err();
    assert!(
        matches!(err, ConfigError::NeedsParameters { .. }),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(text.contains("parameter `limit` is required"), "{text}");
    assert!(text.contains("\"needs-limit\""), "{text}");
    assert!(
        resolved
            .build_named("no-such-policy", WorkerRole::Aggregated, "m")
            .is_none()
    );
    assert!(
        resolved
            .build_named("round-robin", WorkerRole::Aggregated, "m")
            .unwrap()
            .is_ok()
    );

    // Selected by a flag, the same type stops startup naming the flag and the parameter.
    let flags = PolicyOverrides {
        all_roles: flag("needs-limit", "--worker-selection-policy"),
        ..Default::default()
    };
    let err = registry
        .resolve(&WorkerSelectionConfig::default(), &flags)
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("(from --worker-selection-policy)"), "{text}");
    assert!(text.contains("parameter `limit` is required"), "{text}");
}

#[test]
fn duplicate_and_malformed_registrations_are_refused() {
    let mut registry = RouterPluginRegistry::with_builtins();
    let provider: PolicyProvider = Arc::new(crate::policies::random::provider);
    assert_eq!(
        registry.register_worker_selection("random", provider.clone()),
        Err(RegistryError::Duplicate {
            kind: PluginKind::WorkerSelection,
            type_name: "random".into()
        })
    );
    assert!(matches!(
        registry.register_worker_selection("Bad Name", provider.clone()),
        Err(RegistryError::InvalidTypeName { .. })
    ));
    assert!(
        registry
            .register_worker_selection("my-random", provider)
            .is_ok()
    );
    assert!(registry.types().any(|t| t == "my-random"));
}

#[test]
fn the_factory_runs_once_per_build_with_its_partition() {
    let builds = Arc::new(AtomicUsize::new(0));
    let seen = builds.clone();
    let mut registry = RouterPluginRegistry::with_builtins();
    registry
        .register_worker_selection(
            "counting",
            Arc::new(move |_params: &PolicyParameters| {
                let seen = seen.clone();
                let factory: PolicyFactory = Arc::new(move |context: &PolicyBuildContext<'_>| {
                    seen.fetch_add(1, Ordering::SeqCst);
                    if context.role == WorkerRole::Encode {
                        return Err(ProviderError::new("encode is not supported"));
                    }
                    Ok(WorkerSelectionPolicy::new(
                        Vec::new(),
                        Box::new(RoundRobinPicker::default()),
                    )
                    .named("ignored: the registry names it"))
                });
                Ok(factory)
            }),
        )
        .unwrap();
    let config = WorkerSelectionConfig::from_yaml(
        "worker_selection:\n  aggregated: c\n  encode: c\n  instances: [{name: c, type: counting}]\n",
    )
    .unwrap();
    let resolved = registry
        .resolve(&config, &PolicyOverrides::default())
        .unwrap();
    assert_eq!(builds.load(Ordering::SeqCst), 0, "no policy before build");
    let a = resolved.build(WorkerRole::Aggregated, "model-a").unwrap();
    let _b = resolved.build(WorkerRole::Aggregated, "model-b").unwrap();
    assert_eq!(builds.load(Ordering::SeqCst), 2);
    assert_eq!(a.name(), "c");
    let err = resolved.build(WorkerRole::Encode, "model-a").unwrap_err();
    assert!(err.to_string().contains("encode is not supported"), "{err}");
}

fn plugins(yaml: &str) -> Result<RouterPlugins, ConfigError> {
    RouterPluginRegistry::with_builtins().resolve_plugins(
        &RouterPluginsConfig::from_yaml(yaml)?,
        &PolicyOverrides::default(),
    )
}

#[test]
fn the_built_in_classifiers_are_registered_and_none_is_pass_through() {
    let registry = RouterPluginRegistry::with_builtins();
    assert_eq!(
        registry.request_classifier_types().collect::<Vec<_>>(),
        ["max-in-flight", "pass-through"]
    );
    let none = registry
        .resolve_plugins(&RouterPluginsConfig::default(), &PolicyOverrides::default())
        .unwrap();
    assert!(none.classifier.is_none());
    assert_eq!(
        none.policies.selection(WorkerRole::Decode).instance,
        "default"
    );
    let only_classifier =
        plugins("request_classifier:\n  type: max-in-flight\n  parameters: {per_model: 4}\n")
            .unwrap();
    let classifier = only_classifier.classifier.unwrap();
    assert_eq!(classifier.type_name(), "max-in-flight");
    assert_eq!(
        classifier
            .build(&crate::classify::RequestClassifierContext::default())
            .name(),
        "max-in-flight"
    );
}

#[test]
fn classifier_and_policy_names_are_separate_and_registered_once() {
    let mut registry = RouterPluginRegistry::with_builtins();
    let provider: crate::classify::RequestClassifierProvider =
        Arc::new(crate::classify::pass_through::provider);
    let err = registry
        .register_request_classifier("pass-through", provider.clone())
        .unwrap_err();
    assert_eq!(
        err,
        RegistryError::Duplicate {
            kind: PluginKind::RequestClassifier,
            type_name: "pass-through".into()
        }
    );
    assert_eq!(
        err.to_string(),
        "request classifier type \"pass-through\" is already registered"
    );
    assert!(matches!(
        registry.register_request_classifier("", provider.clone()),
        Err(RegistryError::InvalidTypeName {
            kind: PluginKind::RequestClassifier,
            ..
        })
    ));
    // A classifier may share a name with a policy type: each kind is its own name space.
    registry
        .register_request_classifier("random", provider)
        .unwrap();
    assert!(registry.types().any(|t| t == "random"));
    assert!(registry.request_classifier_types().any(|t| t == "random"));
}

#[test]
fn classifier_errors_stop_startup_naming_the_field_or_parameter() {
    let unknown = plugins("request_classifier:\n  type: max-in-flite\n").unwrap_err();
    assert!(matches!(unknown, ConfigError::UnknownClassifierType { .. }));
    assert!(unknown.in_file());
    let text = unknown.to_string();
    assert!(
        text.starts_with("request_classifier.type \"max-in-flite\""),
        "{text}"
    );
    assert!(
        text.contains("registered: max-in-flight, pass-through"),
        "{text}"
    );
    // A policy type name is not a classifier type.
    assert!(matches!(
        plugins("request_classifier: {type: round-robin}\n").unwrap_err(),
        ConfigError::UnknownClassifierType { .. }
    ));

    let bad =
        plugins("request_classifier:\n  type: max-in-flight\n  parameters: {per_worker: 0}\n")
            .unwrap_err();
    assert!(bad.in_file());
    let text = bad.to_string();
    assert!(
        text.contains("request_classifier.parameters")
            && text.contains("parameter `per_worker` must be at least 1"),
        "{text}"
    );
    let typo =
        plugins("request_classifier:\n  type: max-in-flight\n  parameters: {per_workers: 2}\n")
            .unwrap_err();
    assert!(
        typo.to_string().contains("unknown parameter `per_workers`"),
        "{typo}"
    );
    let missing = plugins("request_classifier: {type: max-in-flight}\n").unwrap_err();
    assert!(
        missing.to_string().contains("`per_worker`, `per_model`"),
        "{missing}"
    );
    // Worker selection is still validated next to a classifier.
    let both = plugins(
        "worker_selection:\n  instances: [{name: x, type: nope}]\nrequest_classifier: {type: pass-through}\n",
    )
    .unwrap_err();
    assert!(matches!(both, ConfigError::UnknownType { .. }), "{both:?}");
}

#[test]
fn a_classifier_factory_runs_once_per_partition_never_per_request() {
    use crate::classify::{
        ClassifyRequest, PASS_THROUGH_TYPE, RequestClassifier, RequestClassifierContext,
        RequestClassifierFactory, Verdict,
    };
    let providers = Arc::new(AtomicUsize::new(0));
    let builds = Arc::new(AtomicUsize::new(0));
    let (p, b) = (providers.clone(), builds.clone());
    let mut registry = RouterPluginRegistry::with_builtins();
    registry
        .register_request_classifier(
            "counting",
            Arc::new(move |params: &crate::classify::ClassifierParameters| {
                p.fetch_add(1, Ordering::SeqCst);
                let _: std::collections::BTreeMap<String, u32> = params.deserialize()?;
                let b = b.clone();
                let factory: RequestClassifierFactory = Arc::new(move |_context| {
                    b.fetch_add(1, Ordering::SeqCst);
                    Box::new(crate::classify::pass_through::PassThrough)
                        as Box<dyn RequestClassifier>
                });
                Ok(factory)
            }),
        )
        .unwrap();
    let resolved = registry
        .resolve_plugins(
            &RouterPluginsConfig::from_yaml("request_classifier: {type: counting}\n").unwrap(),
            &PolicyOverrides::default(),
        )
        .unwrap();
    assert_eq!(providers.load(Ordering::SeqCst), 1, "validated at startup");
    assert_eq!(builds.load(Ordering::SeqCst), 0, "nothing built yet");
    let classifier = resolved.classifier.expect("configured");
    let mut partitions: Vec<Box<dyn RequestClassifier>> = ["model-a", "model-b"]
        .iter()
        .map(|_| classifier.build(&RequestClassifierContext::default()))
        .collect();
    for (n, partition) in partitions.iter_mut().enumerate() {
        for i in 0..10u128 {
            let mut request = ClassifyRequest::new(
                uuid::Uuid::from_u128(i),
                "m",
                WorkerRole::Aggregated,
                1,
                n as u64,
            );
            assert!(matches!(
                partition.classify(&mut request, 0),
                Verdict::Admit(_)
            ));
        }
        assert_eq!(partition.name(), PASS_THROUGH_TYPE);
    }
    assert_eq!(builds.load(Ordering::SeqCst), 2, "one per partition");
    assert_eq!(providers.load(Ordering::SeqCst), 1);
}
