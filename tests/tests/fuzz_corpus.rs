//! Every committed input of the fuzz targets (`fuzz/corpus/<target>/`) replayed through the
//! target's own check, on stable and in seconds: a decoder change that breaks a promise a
//! fuzzer once checked (or re-opens a crash it found, whose input joined the corpus) fails
//! here on every test run. Fuzzing itself, which finds new inputs, is `scripts/fuzz`
//! (FUZZING.md).

#[allow(dead_code, clippy::all)]
#[path = "../../fuzz/src/lib.rs"]
mod kvroute_fuzz;

use std::collections::BTreeSet;

use kvroute_tests::workspace_root;

#[test]
fn every_corpus_input_passes_its_targets_check() {
    let fuzz = workspace_root().join("fuzz");
    // The table names exactly the targets that exist, each with committed inputs.
    let files: BTreeSet<String> = std::fs::read_dir(fuzz.join("fuzz_targets"))
        .unwrap()
        .map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            name.strip_suffix(".rs").unwrap().to_owned()
        })
        .collect();
    let listed: BTreeSet<String> = kvroute_fuzz::TARGETS
        .iter()
        .map(|(n, _)| (*n).to_owned())
        .collect();
    assert_eq!(
        files, listed,
        "fuzz/src/lib.rs's TARGETS against fuzz/fuzz_targets/"
    );
    let mut replayed = 0;
    for (name, check) in kvroute_fuzz::TARGETS {
        let dir = fuzz.join("corpus").join(name);
        let inputs: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        assert!(!inputs.is_empty(), "{name}: no committed input");
        for input in inputs {
            let data = std::fs::read(&input).unwrap();
            let outcome = std::panic::catch_unwind(|| check(&data));
            assert!(
                outcome.is_ok(),
                "{name}: {} fails its check",
                input.display()
            );
            replayed += 1;
        }
    }
    assert!(replayed >= kvroute_fuzz::TARGETS.len());
}
