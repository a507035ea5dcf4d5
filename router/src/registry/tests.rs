//! Registry and configuration: precedence, startup errors that name the culprit, factories.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvroute_common::messages::WorkerRole;

use super::*;
use crate::policies::round_robin::RoundRobinPicker;

fn resolve(yaml: &str, overrides: &PolicyOverrides) -> Result<ResolvedPolicies, ConfigError> {
    let config = WorkerSelectionConfig::from_yaml(yaml)?;
    PolicyRegistry::with_builtins().resolve(&config, overrides)
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
        env: Some("rr".into()),
        ..Default::default()
    };
    let with_env = resolve(TWO_INSTANCES, &env).unwrap();
    for role in WorkerRole::ALL {
        assert_eq!(with_env.selection(role).instance, "rr");
        assert_eq!(with_env.selection(role).source, SelectionSource::Env);
    }

    let flags = PolicyOverrides {
        prefill: Some("lb".into()),
        decode: Some("default".into()),
        env: Some("rr".into()),
    };
    let with_flags = resolve(TWO_INSTANCES, &flags).unwrap();
    assert_eq!(with_flags.selection(WorkerRole::Prefill).instance, "lb");
    assert_eq!(
        with_flags.selection(WorkerRole::Prefill).source,
        SelectionSource::RoleFlag
    );
    assert_eq!(with_flags.selection(WorkerRole::Decode).instance, "default");
    assert_eq!(with_flags.selection(WorkerRole::Aggregated).instance, "rr");
    let decode = with_flags.build(WorkerRole::Decode, "m").unwrap();
    assert_eq!(decode.name(), "default");
}

#[test]
fn a_selection_may_name_a_registered_type_directly() {
    let env = PolicyOverrides {
        env: Some("power-of-two".into()),
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
fn a_selection_naming_nothing_stops_startup() {
    let flags = PolicyOverrides {
        decode: Some("nope".into()),
        ..Default::default()
    };
    let err = resolve(TWO_INSTANCES, &flags).unwrap_err();
    assert_eq!(
        err,
        ConfigError::UnknownSelection {
            role: WorkerRole::Decode,
            name: "nope".into(),
            origin: SelectionSource::RoleFlag,
        }
    );
    assert!(err.to_string().contains("role flag"));
}

#[test]
fn duplicate_and_malformed_registrations_are_refused() {
    let mut registry = PolicyRegistry::with_builtins();
    let provider: PolicyProvider = Arc::new(crate::policies::random::provider);
    assert_eq!(
        registry.register("random", provider.clone()),
        Err(RegistryError::Duplicate {
            type_name: "random".into()
        })
    );
    assert!(matches!(
        registry.register("Bad Name", provider.clone()),
        Err(RegistryError::InvalidTypeName { .. })
    ));
    assert!(registry.register("my-random", provider).is_ok());
    assert!(registry.types().any(|t| t == "my-random"));
}

#[test]
fn the_factory_runs_once_per_build_with_its_partition() {
    let builds = Arc::new(AtomicUsize::new(0));
    let seen = builds.clone();
    let mut registry = PolicyRegistry::with_builtins();
    registry
        .register(
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
